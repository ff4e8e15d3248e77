"""The grammar worker process: runs ``MatcherSet`` beside the engine loop (see grammars.py).

Started by ``GrammarProcess`` as ``python -m pagedllm.structured_output.grammar_worker CONN MEM``
with two inherited file descriptors: CONN, one end of a socket pair carrying pickled messages,
and MEM, the shared memory the bitmasks are written to. Messages in:
    ("init", tokenizer_info_json, (turns, rows, words), fill_threads)   first, once
    ("step", ops, fill_ids, turn)    apply ops, then fill rows [0, len(fill_ids)) of turn
Messages out: ("ready",) once initialised; ("step", rejected, seconds) after each step, where
rejected maps a matcher's key -> message and seconds is the step's work; ("error", traceback)
if a step failed as a whole.
The process ends when the connection closes (the engine exited or closed it, at any point,
even before "init"): a normal end, with status 0 and nothing printed. Ctrl-C reaches the whole
process group: the engine handles it and closes the channel, so the worker ignores SIGINT
(``utils/child.py``); SIGTERM ends it at once, and Linux sends SIGTERM if the engine dies
without closing the channel. A real error (a bad "init") prints its traceback and exits 1; a
step that fails is reported to the engine as ("error", traceback).
"""

from __future__ import annotations

import mmap
import sys
import time
import traceback
from collections import OrderedDict
from typing import Any

import numpy as np

from pagedllm.structured_output.matchers import MatcherSet
from pagedllm.utils.channel import Channel
from pagedllm.utils.child import child_channel


class GrammarWorkerState:
    """The compiled grammars the engine sent, by key (``MatcherSet.apply``'s ``resolve``)."""

    def __init__(self, tokenizer_info: Any) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.tokenizer_info = tokenizer_info
        self.grammars: OrderedDict[Any, Any] = OrderedDict()

    def grammar(self, key: Any) -> Any:
        return self.grammars[key]

    def other(self, op: tuple) -> None:
        if op[0] == "grammar":
            compiled = self._xgr.CompiledGrammar.deserialize_json(op[2], self.tokenizer_info)
            self.grammars[op[1]] = compiled
        elif op[0] == "forget":
            self.grammars.pop(op[1], None)
        else:
            raise ValueError(f"unknown grammar operation {op[0]!r}")


def serve(conn: Channel, mem_fd: int) -> None:
    """The worker's loop (see the module docstring); returns when the engine closes the
    channel, whether the worker was reading or answering."""
    try:
        _serve(conn, mem_fd)
    except (EOFError, ConnectionError):  # the engine closed the channel: a normal end
        return


def _serve(conn: Channel, mem_fd: int) -> None:
    import xgrammar as xgr

    kind, info_json, shape, threads = conn.recv()
    assert kind == "init", kind
    state = GrammarWorkerState(xgr.TokenizerInfo.deserialize_json(info_json))
    nbytes = int(np.prod(shape)) * 4
    buf = mmap.mmap(mem_fd, nbytes)
    masks = np.ndarray(shape, dtype=np.int32, buffer=buf)  # [turns, rows, words]
    matchers = MatcherSet(threads)
    conn.send(("ready",))
    while True:
        msg = conn.recv()
        try:
            start = time.perf_counter()
            _, ops, fill_ids, turn = msg
            rejected = matchers.apply(ops, state)
            if fill_ids:
                matchers.fill(fill_ids, masks[turn])
            reply: tuple = ("step", rejected, time.perf_counter() - start)
        except Exception:
            reply = ("error", traceback.format_exc())
        conn.send(reply)


def main(argv: list[str]) -> None:
    serve(child_channel(argv), int(argv[2]))


if __name__ == "__main__":
    main(sys.argv)
