"""The engine core in a process of its own: what ``pagedllm serve`` runs behind its HTTP front.

Started by ``EngineCoreClient`` (``engine/core_client.py``) as ``python -m
pagedllm.engine.core_proc FD``, FD being its end of a socket pair that carries pickled
messages (``Channel``). The process owns the ``EngineCore`` (scheduler, KV-cache manager,
executor and model) and a tokenizer for the grammars; it never detokenizes, checks stop
strings or formats HTTP: the front end does (``engine/mp_async_llm.py``).

Messages in:
    ("init", config, eos_token_id)           first, once; replies ("ready", info) or
                                             ("failed", traceback)
    ("add", id, token_ids, params, priority, arrival_time, cache_salt, lora_request)
    ("beam", id, token_ids, params, beam_params, arrival_time, lora_request)
    ("abort", ids)  /  ("stop", ids)         end requests (client gone / a stop string)
    ("wake",)                                nothing (ends an idle wait: expert parallelism)
    ("utility", call_id, name, args)         "prepare_structured", "compile" (on a helper
                                             thread), "call" (fn(core), between steps)
    ("shutdown",)
Messages out:
    ("out", packed outputs, stats)           after every step, and after commands when idle
    ("step_error", message, ids, dead)       a step failed: the requests ``ids`` were
                                             ended (``EngineCore.step_failed``); dead: the
                                             engine gave up, the process exits next
    ("reply", call_id, ok, value)            ok False: value is the error's message

The loop (``EngineCoreProc.run``): take every command that has arrived (waiting for one only
when idle), step while requests are unfinished, send each step's outputs as ONE message (a
batch of deltas; ``pack_outputs``). No thread competes with it for the GIL except the short
utility ones. The process ends at "shutdown", when a front end closes its channel or dies
(end of file; Linux also sends SIGKILL when the parent exits: ``child_channel``), after
stopping its own worker processes, and with status 1 after a step failure it could not
survive (``MAX_CONSECUTIVE_STEP_FAILURES`` in a row, or broken workers). It ignores SIGTERM:
a signal to the whole process group must not end it under its front ends, which stop it in
order.

Expert parallelism over data-parallel cores: every iteration of the loop agrees on a step
with the other cores (``engine/dp_sync.py``), also when this core has no work (then it joins
the others' MoE exchanges at once); when no core has work it waits for commands at most
``DPStepSync.idle_wait()``. ("wake",) from a front end (sent to every core with each new
request) only ends that wait.

Several front ends (``pagedllm serve --api-server-count N``): the core serves N channels; a
request's outputs go to the front end that sent it, the stats and a step's failure to all.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
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


class _Client:
    """One front end's channel and the messages it has not taken yet."""

    def __init__(self, chan: Channel) -> None:
        self.chan = chan
        self.sock = chan.sock
        self.lock = threading.Lock()
        self.wbuf = bytearray()  # framed messages the socket has not taken yet
        chan.grow_buffers()
        chan.sock.setblocking(False)

    def send(self, data: bytes) -> None:
        """Queue one encoded message and write what the socket takes now, never waiting for
        the front end (a loop blocked on a busy reader would leave the GPU idle): the rest
        goes with the next ``flush``. Helper threads reply too: one writer at a time."""
        with self.lock:
            self.wbuf += Channel.frame(data)
            self._flush_locked()
            if len(self.wbuf) > _MAX_PENDING_BYTES:  # the front end stopped reading: wait
                while self.wbuf:
                    select.select([], [self.sock], [], _POLL_S)
                    self._flush_locked()

    def flush(self) -> None:
        if self.wbuf:
            with self.lock:
                self._flush_locked()

    def drain(self, timeout: float) -> None:
        """Write every queued message, waiting up to ``timeout`` s for the front end (a
        front end that is gone or stuck loses them)."""
        deadline = time.monotonic() + timeout
        with self.lock:
            try:
                while self.wbuf and time.monotonic() < deadline:
                    select.select([], [self.sock], [], _POLL_S)
                    self._flush_locked()
            except OSError:
                pass

    def _flush_locked(self) -> None:
        try:
            n = self.sock.send(self.wbuf)
        except BlockingIOError:
            return
        del self.wbuf[:n]


class EngineCoreProc:
    """The engine core process's loop around one ``EngineCore`` (see the module docstring),
    serving one front end or several (``--api-server-count``): each request's outputs go
    to the front end that sent it; the stats go to all."""

    def __init__(self, core: Any, chans: list[Channel], eos_token_id: int | None) -> None:
        self.core = core
        self.clients = [_Client(c) for c in chans]
        self.eos_token_id = eos_token_id
        self.max_model_len = core.config.model_config.max_model_len
        self._owner: dict[str, int] = {}  # request id -> its front end (several only)
        self.dead = False  # a step failure the engine could not survive: the loop ends

    def send(self, msg: Any, client: int = 0) -> None:
        """Send one message to one front end."""
        self.clients[client].send(encode(msg))

    def broadcast(self, msg: Any) -> None:
        data = encode(msg)
        for c in self.clients:
            c.send(data)

    def flush(self) -> None:
        """Write queued messages the sockets take now."""
        for c in self.clients:
            c.flush()

    def _receive(self, busy: bool, idle_wait: float | None = None) -> list[tuple[int, Any]]:
        """The commands that have arrived, with their front end: at once while requests run;
        when idle, waiting for one (after the queued outputs are out), for at most
        ``idle_wait`` s if given. EOFError when a front end closed its channel."""
        socks = [c.sock for c in self.clients]
        pending = [c.sock for c in self.clients if c.wbuf]
        if busy:
            ready = select.select(socks, [], [], 0.0)[0]
        else:
            wait = _POLL_S if pending else None
            if idle_wait is not None:
                wait = idle_wait if wait is None else min(wait, idle_wait)
            ready, writable, _ = select.select(socks, pending, [], wait)
            if writable:
                self.flush()
        msgs: list[tuple[int, Any]] = []
        for i, c in enumerate(self.clients):
            if c.sock in ready or c.chan.has_message():
                msgs += [(i, m) for m in c.chan.recv_all(0.0)]
        return msgs

    def run(self) -> None:
        """Serve until "shutdown" or the end of a front end's channel (then every front end
        goes: the process exits and they see the end of theirs), also found when writing to
        it fails."""
        try:
            self._run()
        except (BrokenPipeError, ConnectionResetError):
            return  # a front end is gone

    def _run(self) -> None:
        core = self.core
        clock = LoopClock("engine core", ("wait", "commands", "step", "send"))
        # expert parallelism over data-parallel cores: every iteration agrees with the other
        # cores (engine/dp_sync.py), idle or not; an idle core polls its front ends
        sync = getattr(core, "dp_sync", None)
        while True:
            self.flush()
            busy = core.has_unfinished_requests()
            idle_wait = None
            if sync is not None:  # another core's work: join its next step at once
                busy = busy or sync.others_busy
                idle_wait = sync.idle_wait()
            try:
                msgs = self._receive(busy, idle_wait)
            except (EOFError, OSError):
                return  # a front end is gone
            clock.lap("wait")
            for client, msg in msgs:
                if msg[0] == "shutdown":
                    return
                try:
                    self.handle(msg, client)
                except Exception:  # one bad command must not end the engine
                    logger.exception("engine core command %r failed", msg[0])
            clock.lap("commands")
            if core.has_unfinished_requests():
                outputs = self.step()
                clock.lap("step")
                if self.dead:
                    return
                self.send_outputs(outputs)
                clock.lap("send", count=True)
            else:
                if sync is not None:  # the other cores' step, joined with no tokens
                    self.step()
                    if self.dead:
                        return
                if msgs:
                    self.broadcast(("out", [], core.stats()))
                    clock.lap("send")

    def send_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        """One "out" message per front end: its requests' outputs and the stats."""
        stats = self.core.stats()
        if len(self.clients) == 1:
            self.send(("out", pack_outputs(outputs), stats))
            return
        per: list[list[EngineCoreOutput]] = [[] for _ in self.clients]
        owner = self._owner
        for o in outputs:
            rid = o.parent_id or o.request_id
            per[owner.get(rid, 0)].append(o)
            if o.finished and (o.parent_id is None or o.beam_sequences is not None
                               or not self._has_sequences(rid)):  # fmt: skip
                owner.pop(rid, None)
        for i, outs in enumerate(per):
            self.send(("out", pack_outputs(outs), stats), i)

    def _has_sequences(self, rid: str) -> bool:
        """Whether any sequence of request ``rid`` (n > 1) is still in the scheduler."""
        return any(r.parent_id == rid for r in self.core.scheduler.requests.values())

    def step(self) -> list[EngineCoreOutput]:
        """One ``EngineCore.step``; if it raises, ``EngineCore.step_failed`` ends the requests
        it may have left wrong and the front ends are told ("step_error": they fail those
        streams); the loop goes on serving, unless the engine is dead (``self.dead``)."""
        core = self.core
        try:
            return core.step()
        except Exception as e:
            logger.exception("engine step failed")
            failure = core.step_failed(e)
            logger.error("%s; %d requests ended", failure.message, len(failure.request_ids))
            for rid in failure.request_ids:
                self._owner.pop(rid, None)
            self.dead = failure.dead
            # every front end: each fails the ids it owns (the others are unknown to it)
            self.broadcast(("step_error", failure.message, failure.request_ids, failure.dead))
            return []

    def handle(self, msg: tuple, client: int = 0) -> None:
        """Carry out one command of front end ``client`` (see the module docstring)."""
        kind = msg[0]
        core = self.core
        if kind in ("add", "beam") and len(self.clients) > 1:
            self._owner[msg[1]] = client
        if kind == "add":
            _, rid, ids, params, priority, arrival, salt, lora = msg
            try:
                request = self._request(rid, ids, params, priority, arrival)
                request.cache_salt = salt
                request.lora_request = lora
                core.add_request(request)
            except Exception as e:  # the front end checked already; this request only
                self._refuse(rid, e, client)
        elif kind == "beam":
            _, rid, ids, params, beam_params, arrival, lora = msg
            try:
                eos = {self.eos_token_id} if self.eos_token_id is not None else set()
                request = self._request(rid, ids, params, 0, arrival)
                request.lora_request = lora
                core.add_beam_request(request, beam_params, eos)
            except Exception as e:
                self._refuse(rid, e, client)
        elif kind in ("abort", "stop"):  # no output follows: forget whose they were
            for rid in msg[1]:
                self._owner.pop(rid, None)
            if kind == "abort":
                core.abort_requests(msg[1])
            else:
                core.finish_requests_stopped(msg[1])
        elif kind == "wake":  # expert parallelism: another core has a request
            pass
        elif kind == "utility":
            self._utility(client, *msg[1:])
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

    def _refuse(self, rid: str, e: Exception, client: int) -> None:
        self._owner.pop(rid, None)
        out = EngineCoreOutput(rid, [], finish_reason="abort", error=f"{type(e).__name__}: {e}")
        self.send(("out", pack_outputs([out]), self.core.stats()), client)

    def _utility(self, client: int, call_id: int, name: str, args: tuple) -> None:
        core = self.core
        if name == "call":  # between steps, on this thread: fn may touch the scheduler
            self._reply(client, call_id, lambda: args[0](core))
            return

        def prepare() -> None:
            core.structured_output_manager()

        def compile_grammar() -> None:
            core.structured_output_manager().compile_now(args[0])

        job = {"prepare_structured": prepare, "compile": compile_grammar}.get(name)
        if job is None:
            error = ("ValueError", f"unknown utility {name!r}")
            self.send(("reply", call_id, False, error), client)
            return
        # grammar work takes seconds: on a helper thread, never between the steps
        threading.Thread(
            target=self._reply, args=(client, call_id, job), name=f"pagedllm-{name}", daemon=True
        ).start()

    def _reply(self, client: int, call_id: int, job: Any) -> None:
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
            self.send(("reply", call_id, ok, value), client)
        except OSError:
            pass


def serve(chan: Channel, others: list[Channel] | None = None) -> int:
    """Build the engine core from the "init" message on ``chan``, then run its loop for it
    and the ``others`` front ends (more API servers). Exit status."""
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
        proc = EngineCoreProc(core, [chan, *(others or [])], eos_token_id)
        proc.run()
        if proc.dead:
            for c in proc.clients:  # the "step_error" that says why, before the end of file
                c.drain(5.0)
    finally:
        core.shutdown()
    return 1 if proc.dead else 0


def main(argv: list[str]) -> None:
    """Entry point: serve on the inherited sockets ``argv[1:]`` (the first carries "init")."""
    logging.basicConfig(
        level=os.environ.get("PAGEDLLM_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s engine-core %(name)s: %(message)s",
    )
    # SIGTERM sent to the whole group (systemd, a shell's timeout) must not cut the core
    # down under its front ends: they stop it over the channel. If the server process dies
    # without doing so, the kernel kills the core (SIGKILL: it holds nothing to save).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    chan = child_channel(argv, death_signal=signal.SIGKILL)
    others = []
    for fd in argv[2:]:
        os.set_inheritable(int(fd), False)
        others.append(Channel(socket.socket(fileno=int(fd))))
    sys.exit(serve(chan, others))


if __name__ == "__main__":
    main(sys.argv)
