"""The engine core in a process of its own: what ``pagedllm serve`` runs behind its HTTP front.

Started by ``EngineCoreClient`` (``engine/core_client.py``) as ``python -m
pagedllm.engine.core_proc FD``, FD being its end of a socket pair that carries pickled
messages (``Channel``). The process owns the ``EngineCore`` (scheduler, KV-cache manager,
executor and model) and a tokenizer for the grammars; it never detokenizes, checks stop
strings or formats HTTP: the front end does (``engine/mp_async_llm.py``).

Messages in:
    ("init", config, eos_token_id)           first, once; replies ("ready", info) or
                                             ("failed", traceback)
    ("add", id, token_ids, params, priority, arrival_time, cache_salt)
    ("beam", id, token_ids, params, beam_params, arrival_time)
    ("abort", ids)  /  ("stop", ids)         end requests (client gone / a stop string)
    ("utility", call_id, name, args)         "prepare_structured", "compile" (on a helper
                                             thread), "call" (fn(core), between steps)
    ("shutdown",)
Messages out:
    ("out", packed outputs, stats)           after every step, and after commands when idle
    ("step_error", message)                  a step failed: every request was aborted
    ("reply", call_id, ok, value)            ok False: value is the error's message

The loop (``EngineCoreProc.run``): take every command that has arrived (waiting for one only
when idle), step while requests are unfinished, send each step's outputs as ONE message (a
batch of deltas; ``pack_outputs``). No thread competes with it for the GIL except the short
utility ones. The process ends at "shutdown", when the front end closes the channel or dies
(end of file; Linux also sends SIGTERM when the parent exits: ``child_channel``), after
stopping its own worker processes.
"""

from __future__ import annotations

import logging
import os
import select
import struct
import sys
import threading
import time
import traceback
from typing import Any

from pagedllm.core.request import Request
from pagedllm.core.sched.output import EngineCoreOutput, pack_outputs
from pagedllm.utils.channel import Channel, encode
from pagedllm.utils.child import child_channel
from pagedllm.utils.loop_clock import LoopClock

logger = logging.getLogger(__name__)

_POLL_S = 1.0
_MAX_PENDING_BYTES = 256 << 20  # outputs the front end has not read before the loop waits


class EngineCoreProc:
    """The engine core process's loop around one ``EngineCore`` (see the module docstring)."""

    def __init__(self, core: Any, chan: Channel, eos_token_id: int | None) -> None:
        self.core = core
        self.chan = chan
        self.eos_token_id = eos_token_id
        self.max_model_len = core.config.model_config.max_model_len
        self._send_lock = threading.Lock()
        self._wbuf = bytearray()  # framed messages the socket has not taken yet
        chan.grow_buffers()
        chan.sock.setblocking(False)

    def send(self, msg: Any) -> None:
        """Queue one message and write what the socket takes now, never waiting for the front
        end (a loop blocked on a busy reader would leave the GPU idle): the rest goes with
        the next ``flush``. Helper threads reply too: one writer at a time."""
        data = encode(msg)
        with self._send_lock:
            self._wbuf += struct.pack("<I", len(data))
            self._wbuf += data
            self._flush_locked()
            if len(self._wbuf) > _MAX_PENDING_BYTES:  # the front end stopped reading: wait
                while self._wbuf:
                    select.select([], [self.chan.sock], [], _POLL_S)
                    self._flush_locked()

    def flush(self) -> None:
        """Write queued messages the socket takes now."""
        if self._wbuf:
            with self._send_lock:
                self._flush_locked()

    def _flush_locked(self) -> None:
        try:
            n = self.chan.sock.send(self._wbuf)
        except BlockingIOError:
            return
        del self._wbuf[:n]

    def _wait_timeout(self, busy: bool) -> float | None:
        """How long to wait for commands: not at all while requests run; when idle, until a
        command comes, after the queued outputs are out."""
        if busy:
            return 0.0
        while self._wbuf:
            select.select([self.chan.sock], [self.chan.sock], [], _POLL_S)
            self.flush()
            if self.chan.poll():
                return 0.0
        return None

    def run(self) -> None:
        """Serve until "shutdown" or the end of the channel."""
        core = self.core
        clock = LoopClock("engine core", ("wait", "commands", "step", "send"))
        while True:
            self.flush()
            try:
                msgs = self.chan.recv_all(self._wait_timeout(core.has_unfinished_requests()))
            except (EOFError, OSError):
                return  # the front end is gone
            clock.lap("wait")
            for msg in msgs:
                if msg[0] == "shutdown":
                    return
                try:
                    self.handle(msg)
                except Exception:  # one bad command must not end the engine
                    logger.exception("engine core command %r failed", msg[0])
            clock.lap("commands")
            if core.has_unfinished_requests():
                outputs = self.step()
                clock.lap("step")
                self.send(("out", pack_outputs(outputs), core.stats()))
                clock.lap("send", count=True)
            elif msgs:
                self.send(("out", [], core.stats()))
                clock.lap("send")

    def step(self) -> list[EngineCoreOutput]:
        """One ``EngineCore.step``; if it raises, every request is aborted and the front end
        told (it fails their streams); the loop goes on serving new requests."""
        core = self.core
        try:
            return core.step()
        except Exception as e:
            ids = core.request_ids()
            logger.exception("engine step failed; aborting the %d requests in flight", len(ids))
            try:
                core.abort_requests(ids)
            except Exception:
                logger.exception("abort after a failed step failed too")
            self.send(("step_error", f"the engine failed while running this request: {e!r}"))
            return []

    def handle(self, msg: tuple) -> None:
        """Carry out one command (see the module docstring)."""
        kind = msg[0]
        core = self.core
        if kind == "add":
            _, rid, ids, params, priority, arrival, salt = msg
            try:
                request = self._request(rid, ids, params, priority, arrival)
                request.cache_salt = salt
                core.add_request(request)
            except Exception as e:  # the front end checked already; this request only
                self._refuse(rid, e)
        elif kind == "beam":
            _, rid, ids, params, beam_params, arrival = msg
            try:
                eos = {self.eos_token_id} if self.eos_token_id is not None else set()
                core.add_beam_request(self._request(rid, ids, params, 0, arrival), beam_params, eos)
            except Exception as e:
                self._refuse(rid, e)
        elif kind == "abort":
            core.abort_requests(msg[1])
        elif kind == "stop":
            core.finish_requests_stopped(msg[1])
        elif kind == "utility":
            self._utility(*msg[1:])
        elif kind == "bad message":
            logger.error("a message from the front end did not unpickle: %s", msg.error)
        else:
            logger.error("unknown engine core message %r", kind)

    def _request(
        self, rid: str, ids: list[int], params: Any, priority: int, arrival: float
    ) -> Request:
        return Request(
            rid,
            ids,
            params,
            eos_token_id=self.eos_token_id,
            arrival_time=arrival,
            priority=priority,
            max_model_len=self.max_model_len,
        )

    def _refuse(self, rid: str, e: Exception) -> None:
        out = EngineCoreOutput(rid, [], finish_reason="abort", error=f"{type(e).__name__}: {e}")
        self.send(("out", pack_outputs([out]), self.core.stats()))

    def _utility(self, call_id: int, name: str, args: tuple) -> None:
        core = self.core
        if name == "call":  # between steps, on this thread: fn may touch the scheduler
            self._reply(call_id, lambda: args[0](core))
            return

        def prepare() -> None:
            core.structured_output_manager()

        def compile_grammar() -> None:
            core.structured_output_manager().compile_now(args[0])

        job = {"prepare_structured": prepare, "compile": compile_grammar}.get(name)
        if job is None:
            self.send(("reply", call_id, False, ("ValueError", f"unknown utility {name!r}")))
            return
        # grammar work takes seconds: on a helper thread, never between the steps
        threading.Thread(
            target=self._reply, args=(call_id, job), name=f"pagedllm-{name}", daemon=True
        ).start()

    def _reply(self, call_id: int, job: Any) -> None:
        """Run ``job()`` and send ("reply", call_id, ok, value): its result, or ("ValueError",
        message) if it raised one (the caller's mistake, e.g. a bad grammar), or ("Error",
        "Type: message") for anything else."""
        try:
            value = job()
            ok = True
        except ValueError as e:
            value, ok = ("ValueError", str(e)), False
        except Exception as e:  # noqa: BLE001 - handed to the caller
            value, ok = ("Error", f"{type(e).__name__}: {e}"), False
        try:
            self.send(("reply", call_id, ok, value))
        except OSError:
            pass


def serve(chan: Channel) -> int:
    """Build the engine core from the "init" message, then run its loop. Exit status."""
    try:
        kind, config, eos_token_id = chan.recv()
    except (EOFError, OSError):
        return 1
    assert kind == "init", kind
    t0 = time.monotonic()
    try:
        from pagedllm.engine.core import EngineCore
        from pagedllm.model.loader import load_tokenizer

        mc = config.model_config
        tokenizer = load_tokenizer(
            mc.model, mc.tokenizer if mc.tokenizer != mc.model else None, mc.load_format
        )
        eos = {eos_token_id} if eos_token_id is not None else set()
        core = EngineCore(config, eos, tokenizer)
    except BaseException:
        chan.send(("failed", traceback.format_exc()))
        return 1
    try:
        info = {
            "pid": os.getpid(),
            "num_blocks": core.num_blocks,
            "token_capacity": core.scheduler.kv_cache_manager.token_capacity(),
            "max_num_seqs": config.scheduler_config.max_num_seqs,
            "stats": core.stats(),
            "build_seconds": time.monotonic() - t0,
        }
        chan.send(("ready", info))
        EngineCoreProc(core, chan, eos_token_id).run()
    finally:
        core.shutdown()
    return 0


def main(argv: list[str]) -> None:
    """Entry point: serve on the inherited socket ``argv[1]``."""
    logging.basicConfig(
        level=os.environ.get("PAGEDLLM_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s engine-core %(name)s: %(message)s",
    )
    sys.exit(serve(child_channel(argv)))


if __name__ == "__main__":
    main(sys.argv)
