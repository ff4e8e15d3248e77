"""Grammar matchers beside the engine loop.

The scheduler records what happens to structured requests (a grammar is ready, a token was
sampled, a sequence forked, a request ended) as operations; once a step, ``submit`` sends them
with the ids of the requests that sample next, and ``collect`` returns that step's bitmask and
the tokens a grammar rejected. Two implementations of one interface:

- ``GrammarProcess`` (the default on a GPU): the matchers live in a worker process, so
  advancing 128 grammars and filling their bitmask (~1 ms of CPU a step) runs beside the
  engine loop's own host work - output processing, scheduling - instead of adding to it. A
  thread cannot do this: every return from xgrammar needs the GIL, held by the busy loop.
  The bitmask comes back through shared memory registered as pinned, so its copy to the
  device is asynchronous; the messages are one pickled tuple each way per step.
- ``LocalGrammars`` (the default on a CPU, where the forward pass already uses every core):
  the same work, done at ``collect`` in the engine's process.

A grammar terminates exactly when it accepts one of the tokenizer's stop tokens (the bitmask
allows them only where the grammar may end), so the scheduler finishes such a request at once
from the token id (``stop_token_ids``); only a rejected token, which a correct bitmask never
lets through, is reported a step later.
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pagedllm.structured_output.matchers import MatcherSet, fill_rows
from pagedllm.utils.channel import Channel

logger = logging.getLogger(__name__)

Key = Hashable  # a matcher's name: the request's grammar_key (any hashable in tests)

_TURNS = 2  # bitmask buffers: the child fills one while the last one's copy may be queued


@dataclass
class GrammarStep:
    """What ``collect`` returns: the bitmask rows of ``fill_ids`` (host memory, pinned where
    the device is a GPU; ``fill_rows(fill_ids)`` rows: 1 + k for a ``SpecFill`` with k
    drafts) and the requests whose token a grammar rejected (id -> message)."""

    fill_ids: list[Key]
    mask: torch.Tensor | None  # [len(fill_ids), ceil(vocab / 32)] int32
    rejected: dict[Key, str] = field(default_factory=dict)
    work_seconds: float = 0.0  # the accept + fill work (in the worker: beside the loop)


class Grammars:
    """The interface, and the operation buffer both implementations share. At most one step
    is in flight: ``submit`` then ``collect``."""

    def __init__(self) -> None:
        self._ops: list[tuple] = []
        self._in_flight: tuple[list[Key], int] | None = None
        self._turn = 0

    # -- operations, buffered in order until the next submit
    def add(self, key: Key, entry: Any) -> None:
        """A matcher at the start of ``entry``'s grammar (a ``GrammarEntry``), named ``key``
        (the request's ``grammar_key``)."""
        self._ops.append(("add", key, entry.grammar))

    def fork(self, parent: Key, child: Key) -> None:
        """The child sequence continues from the parent's grammar state."""
        self._ops.append(("fork", parent, child))

    def accept(self, key: Key, token_id: int) -> None:
        """Advance the request's grammar by one sampled token."""
        self._ops.append(("accept", key, token_id))

    def accept_many(self, keys: list[Key], token_ids: list[int]) -> None:
        """``accept`` for each pair, in order (one operation for a step's tokens)."""
        self._ops.append(("accepts", keys, token_ids))

    def rollback(self, key: Key, num_tokens: int) -> None:
        """Undo the request's last ``num_tokens`` accepted tokens."""
        self._ops.append(("rollback", key, num_tokens))

    def drop(self, key: Key) -> None:
        """The request ended: free its matcher."""
        self._ops.append(("drop", key))

    # -- steps
    @property
    def in_flight(self) -> bool:
        return self._in_flight is not None

    @property
    def has_pending_ops(self) -> bool:
        return bool(self._ops)

    def ready(self) -> bool:
        """Whether grammars can be added and stepped without waiting (the worker is up)."""
        return True

    def submit(self, fill_ids: list[Key]) -> None:
        """Apply the buffered operations, then fill the bitmask of ``fill_ids`` (the
        structured requests that sample next, in any order)."""
        assert self._in_flight is None, "collect the last grammar step first"
        ops, self._ops = self._ops, []
        turn = self._turn
        self._turn = (turn + 1) % _TURNS
        self._in_flight = (fill_ids, turn)
        self._send(ops, fill_ids, turn)

    def collect(self) -> GrammarStep:
        """Wait for the submitted step."""
        assert self._in_flight is not None, "no grammar step in flight"
        fill_ids, turn = self._in_flight
        self._in_flight = None
        rejected, seconds = self._receive()
        mask = self._masks[turn][: fill_rows(fill_ids)] if fill_ids else None
        return GrammarStep(fill_ids, mask, rejected, seconds)

    def close(self) -> None:
        """Free what the implementation holds (the worker process)."""

    _masks: torch.Tensor  # [turns, rows, words] int32

    def _send(self, ops: list[tuple], fill_ids: list[Key], turn: int) -> None:
        raise NotImplementedError

    def _receive(self) -> tuple[dict[Key, str], float]:
        raise NotImplementedError


class LocalGrammars(Grammars):
    """Matchers in the engine's process; the work happens in ``collect``."""

    def __init__(self, max_rows: int, words: int, pin: bool, fill_threads: int | str) -> None:
        super().__init__()
        self._masks = torch.empty((_TURNS, max_rows, words), dtype=torch.int32, pin_memory=pin)
        self._matchers = MatcherSet(fill_threads)
        self._job: tuple[list[tuple], list[Key], int] | None = None

    def _send(self, ops: list[tuple], fill_ids: list[Key], turn: int) -> None:
        self._job = (ops, fill_ids, turn)

    def _receive(self) -> tuple[dict[Key, str], float]:
        assert self._job is not None
        start = time.perf_counter()
        ops, fill_ids, turn = self._job
        self._job = None
        rejected = self._matchers.apply(ops)
        if fill_ids:
            self._matchers.fill(fill_ids, self._masks[turn])
        return rejected, time.perf_counter() - start


class GrammarProcess(Grammars):
    """Matchers in a worker process (``grammar_worker.py``). Compiled grammars travel once
    per key as xgrammar's JSON (made on the compile thread pool, see compiler.py); the worker
    keeps the last ``keep_grammars`` of them, in step with this side's record."""

    def __init__(
        self,
        tokenizer_info_json: str,
        max_rows: int,
        words: int,
        pin: bool,
        fill_threads: int | str,
        keep_grammars: int = 256,
    ) -> None:
        super().__init__()
        shape = (_TURNS, max_rows, words)
        nbytes = _TURNS * max_rows * words * 4
        self._mem_file = _shared_file(nbytes)
        self._mmap = mmap.mmap(self._mem_file.fileno(), nbytes)
        self._masks = torch.from_numpy(np.ndarray(shape, dtype=np.int32, buffer=self._mmap))
        self._registered = pin and _register_pinned(self._masks)
        self._keys: OrderedDict[Any, None] = OrderedDict()
        self._keep = keep_grammars
        self._ready = False
        ours, theirs = socket.socketpair()
        self._conn = Channel(ours)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        cmd = [sys.executable, "-m", "pagedllm.structured_output.grammar_worker"]
        fds = (theirs.fileno(), self._mem_file.fileno())
        self._proc = subprocess.Popen(
            [*cmd, *map(str, fds)], pass_fds=fds, env=env, stdin=subprocess.DEVNULL
        )
        theirs.close()
        self._conn.send(("init", tokenizer_info_json, shape, fill_threads))

    def add(self, key: Key, entry: Any) -> None:
        spec = entry.key  # the grammar's cache key: sent once, then named
        if spec in self._keys:
            self._keys.move_to_end(spec)
        else:
            assert entry.json is not None, "the compiler did not serialize this grammar"
            self._ops.append(("grammar", spec, entry.json))
            self._keys[spec] = None
            if len(self._keys) > self._keep:
                self._ops.append(("forget", self._keys.popitem(last=False)[0]))
        self._ops.append(("add", key, spec))

    def ready(self) -> bool:
        if not self._ready and self._conn.poll():
            self._expect_ready()
        return self._ready

    def _expect_ready(self) -> None:
        msg = self._recv()
        if msg[0] != "ready":
            raise RuntimeError(f"grammar worker: expected 'ready', got {msg[0]!r}")
        self._ready = True

    def _send(self, ops: list[tuple], fill_ids: list[Key], turn: int) -> None:
        try:
            self._conn.send(("step", ops, fill_ids, turn))
        except OSError as e:
            raise self._died() from e

    def _receive(self) -> tuple[dict[Key, str], float]:
        if not self._ready:
            self._expect_ready()
        msg = self._recv()
        if msg[0] == "error":
            raise RuntimeError(f"grammar worker failed a step:\n{msg[1]}")
        return msg[1], msg[2]

    def _recv(self) -> tuple:
        try:
            return self._conn.recv()
        except (EOFError, OSError) as e:
            raise self._died() from e

    def _died(self) -> RuntimeError:
        code = self._proc.poll()
        return RuntimeError(f"the grammar worker process exited (code {code})")

    def close(self) -> None:
        if self._proc is None:
            return
        self._conn.close()  # the worker sees the end of its input and exits
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc = None
        if self._registered:
            torch.cuda.cudart().cudaHostUnregister(self._masks.data_ptr())
            self._registered = False

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: modules may be gone
            pass


def _shared_file(nbytes: int) -> Any:
    """An anonymous file of ``nbytes`` both processes map: memfd on Linux, else a deleted
    temporary file."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("pagedllm-grammar-bitmask")
        f = os.fdopen(fd, "r+b", buffering=0)
    else:  # pragma: no cover - not Linux
        f = tempfile.TemporaryFile()
    os.ftruncate(f.fileno(), nbytes)
    return f


def _register_pinned(t: torch.Tensor) -> bool:
    """Page-lock ``t``'s memory for the GPU (cudaHostRegister), so copies from it are
    asynchronous DMA; False (with a warning) where the driver refuses."""
    nbytes = t.numel() * t.element_size()
    try:
        err = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0))
    except Exception as e:  # a torch build without the binding
        err = -1
        logger.warning("could not pin the grammar bitmask buffer: %s", e)
    if err != 0:
        logger.warning("grammar bitmask buffer not pinned (cudaError %d): copies will wait", err)
        return False
    return True


def fill_threads() -> int | str | None:
    """Threads xgrammar fills a batch's bitmask on: PAGEDLLM_GRAMMAR_THREADS ("auto" is
    xgrammar's default, half the hardware threads), or None when unset."""
    value = os.environ.get("PAGEDLLM_GRAMMAR_THREADS")
    if value is None or value == "auto":
        return value
    if not value.isdigit() or int(value) < 1:
        raise ValueError(
            f"PAGEDLLM_GRAMMAR_THREADS must be 'auto' or a positive int, got {value!r}"
        )
    return int(value)


def make_grammars(
    process: bool, manager: Any, max_rows: int, pin: bool, fill_threads: int | str | None
) -> Grammars:
    """The grammar matchers of an engine: in a worker process or in this one. Unless set,
    the worker fills on 2 threads (its fill has the engine loop's output processing to hide
    behind, and fewer threads leave the loop's cores alone); in the loop, xgrammar's default."""
    words = (manager.vocab_size + 31) // 32
    if fill_threads is None:
        fill_threads = 2 if process else "auto"
    if process:
        info = manager.tokenizer_info.serialize_json()
        return GrammarProcess(info, max_rows, words, pin, fill_threads)
    return LocalGrammars(max_rows, words, pin, fill_threads)
