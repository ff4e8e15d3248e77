"""MPAsyncLLM: the server's front end for an engine core in its own process (vLLM V1's layout).

Why: with the engine loop on a thread of the HTTP process (``AsyncLLM``), the two share one
interpreter lock. Under load the engine thread waits for the HTTP thread's Python work
(parsing, tokenization, detokenization, SSE framing) and vice versa, and on a GPU the server
falls far below the engine's own throughput (the server-against-engine GPU benchmark in
``benchmarks/README.md`` measures both front ends). Here the engine core
(scheduler, KV cache, model: ``engine/core_proc.py``) runs alone in its process and only
steps; this process does everything else:

- tokenization and validation (``InputProcessor``), the admission checks the scheduler would
  make (``check_admissible`` against the KV capacity the core reported), then ONE message per
  request to the core;
- per step, ONE message back with every request's new tokens (a batch of deltas), read by the
  event loop itself (``loop.add_reader``: no thread, so no lock handoffs in this process
  either); detokenization, stop strings and logprob dicts here (``OutputProcessor``); a stop
  string found here ends the request in the core by message ("stop");
- streams: each request's deltas go to its ``RequestStream``, which merges what queued up
  while its consumer was busy (a client that falls behind gets fewer, larger SSE events).

Messages to the core are buffered and written without blocking the loop (a full socket
buffer makes the loop wait for writability, never for the core), so the two processes can
never block each other. A step that fails in the core ends only the requests it may have
left wrong ("step_error": their streams raise ``EngineError``). If the core process dies (or
exits after too many failed steps in a row), every stream gets ``EngineDeadError``,
``is_running`` turns False (``/health`` answers 503) and the ``on_dead`` callbacks run (the
server exits). The core ends when this process closes the channel or dies
(``utils/child.py``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import itertools
import logging
import threading
from collections.abc import Callable
from typing import Any

from pagedllm.beam_search import BeamSearchParams
from pagedllm.config import EngineArgs, EngineConfig
from pagedllm.core.sched.checks import check_admissible
from pagedllm.core.sched.output import unpack_outputs
from pagedllm.engine.async_llm import (
    AsyncLLMBase,
    EngineDeadError,
    EngineError,
    RequestStream,
    StatLogger,
    cache_salt_of,
    put_all,
)
from pagedllm.engine.core_client import AttachedCore, EngineCoreClient
from pagedllm.engine.input_processor import InputProcessor
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.lora.request import LoRARequest
from pagedllm.model.loader import load_tokenizer
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams, beam_sampling_params
from pagedllm.utils.channel import Channel, encode
from pagedllm.utils.loop_clock import LoopClock

logger = logging.getLogger(__name__)

_READ_SIZE = 1 << 20


class MPAsyncLLM(AsyncLLMBase):
    """Serves asyncio callers from an engine core process (see the module docstring).

    The constructor starts the process and returns when its model is built
    (``startup_seconds``). Everything else runs on the event loop it first meets
    (``start()`` or the first request); ``abort_nowait`` may be called from any thread.
    """

    def __init__(
        self,
        config: EngineConfig,
        stat_loggers: list[StatLogger] | None = None,
        api_server_count: int = 1,
        attach: tuple[Channel, dict[str, Any], int] | None = None,
        core_env: dict[str, str] | None = None,
        defer_ready: bool = False,
    ) -> None:
        """Start an engine core process with channels for ``api_server_count`` front ends
        (this one, and the others in ``core.extra_channels`` to hand to API server
        processes), ``core_env`` set in its environment; or, with ``attach`` = (channel,
        the core's info, index), be front end ``index`` of a core another process started.
        ``defer_ready``: return once the core process is started; ``finish_start()`` waits
        for it to be ready (several cores then start at once)."""
        mc = config.model_config
        tokenizer = load_tokenizer(
            mc.model, mc.tokenizer if mc.tokenizer != mc.model else None, mc.load_format
        )
        lora = config.lora_config is not None
        super().__init__(
            config,
            tokenizer,
            InputProcessor(mc, tokenizer, config.kvc_config.enabled, lora),
            stat_loggers,
        )
        self.output_processor = OutputProcessor(tokenizer, config.cache_config.kv_transfer)
        self.index = 0
        if attach is None:
            eos = self.input_processor.eos_token_id
            self.core: EngineCoreClient | AttachedCore = EngineCoreClient(
                config, eos, api_server_count, core_env, wait=not defer_ready
            )
        else:
            chan, info, self.index = attach
            self.core = AttachedCore(chan, info)
        self.core.chan.grow_buffers()
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._wbuf = bytearray()
        self._writing = False
        self._calls: dict[int, concurrent.futures.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._structured_ready: concurrent.futures.Future[Any] | None = None
        self._stopping = False
        self._dead: str | None = None
        self._dead_reason: str | None = None  # why the core is about to exit ("step_error")
        self.on_dead: list[Callable[[str], None]] = []
        # the loop's time: handling the core's messages (outputs, detokenization, delivery)
        # vs everything else (HTTP, SSE); logged with PAGEDLLM_LOOP_STATS=SECONDS
        self._clock = LoopClock("front end", ("rest of the event loop", "core messages"))
        if not defer_ready:
            self.finish_start()

    def finish_start(self) -> None:
        """Wait for the core to be ready and take its start-up info."""
        if isinstance(self.core, EngineCoreClient) and not self.core.info:
            self.core.wait_ready()
        info = self.core.info
        self.num_blocks: int = info["num_blocks"]
        self.token_capacity: int = info["token_capacity"]
        self.max_num_seqs: int = info["max_num_seqs"]
        self.startup_seconds = self.core.startup_seconds
        self._stats = {**info["stats"], "num_streams": 0}
        # The objects of start-up (torch, transformers, the tokenizer: millions) would be
        # walked by every full collection, a pause of up to a second for every stream and
        # every request arriving then. Frozen, they are skipped (the engine core does the
        # same on GPUs; vLLM's API server too).
        gc.collect()
        gc.freeze()

    @classmethod
    def from_engine_args(
        cls, args: EngineArgs, stat_loggers: list[StatLogger] | None = None
    ) -> MPAsyncLLM:
        """Start the engine core process (it loads the model: slow) and connect to it."""
        return cls(args.create_engine_config(), stat_loggers)

    def new_request_id(self, prefix: str = "req") -> str:
        self._ids += 1
        return f"{prefix}-{self.index}-{self._ids}"  # unique across the API servers

    # ------------------------------------------------------------------ state

    @property
    def is_running(self) -> bool:
        """True while the core process is alive and this front end accepts work."""
        return (
            self._dead is None
            and self._dead_reason is None
            and not self._stopping
            and self.core.exit_code() is None
        )

    def _check_running(self) -> None:
        if not self.is_running:
            raise EngineDeadError(self._dead or self._dead_reason or "the engine is not running.")

    @property
    def num_unfinished(self) -> int:
        """Requests this front end still tracks (queued, running or not yet delivered)."""
        return len(self._streams)

    def has_request(self, request_id: str) -> bool:
        """Whether this front end tracks an unfinished request with that id."""
        return request_id in self._streams

    async def start(self) -> None:
        self._attach()

    def _attach(self) -> None:
        """Read the core's messages on the running loop (moving from a closed one)."""
        loop = asyncio.get_running_loop()
        if loop is self._loop:
            return
        sock = self.core.chan.sock
        old = self._loop
        if old is not None and not old.is_closed():
            old.remove_reader(sock.fileno())
            old.remove_writer(sock.fileno())
        self._loop, self._loop_thread = loop, threading.get_ident()
        self._writing = False
        sock.setblocking(False)
        loop.add_reader(sock.fileno(), self._on_readable)
        if self._wbuf:
            self._flush()

    # ------------------------------------------------------------------ requests

    async def _queue(
        self,
        prompt: Any,
        text: str | None,
        ids: list[int],
        params: SamplingParams | BeamSearchParams,
        request_id: str | None,
        priority: int,
        output_kind: str,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        self._attach()
        self._check_running()
        rid = request_id or self.new_request_id()
        if rid in self._streams:
            raise ValueError(f"request_id {rid!r} is already in use.")
        salt = cache_salt_of(prompt, params)
        beam = isinstance(params, BeamSearchParams)
        if beam and params.beam_width > self.max_num_seqs:
            raise ValueError(
                f"beam_width ({params.beam_width}) is larger than max_num_seqs "
                f"({self.max_num_seqs})."
            )
        sp = beam_sampling_params(params) if beam else params
        request, _ = self.input_processor.process(
            rid, {"prompt_token_ids": ids}, sp, priority, lora_request=lora_request
        )
        # the scheduler's own admission check, against the capacity the core reported: a
        # request it would refuse is a ValueError here, before anything is sent
        check_admissible(
            request, self.max_num_seqs, self.model_config.max_model_len, self.token_capacity
        )
        sp = request.sampling_params
        self.output_processor.add_request(rid, text, ids, sp, "final" if beam else output_kind)
        stream = RequestStream(rid, self, asyncio.get_running_loop())
        self._streams[rid] = stream
        if beam:
            self._send(("beam", rid, ids, sp, params, request.arrival_time, lora_request))
        else:
            self._send(("add", rid, ids, sp, priority, request.arrival_time, salt, lora_request))
        return stream

    def abort_nowait(self, request_id: str | list[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        loop = self._loop
        if loop is not None and threading.get_ident() != self._loop_thread:
            try:
                loop.call_soon_threadsafe(self._abort, ids)
            except RuntimeError:  # the loop is closed: nothing runs any more
                pass
            return
        self._abort(ids)

    def _abort(self, ids: list[str]) -> None:
        ids = [i for i in ids if i in self._streams]
        if not ids:
            return
        outputs = [o for o in (self.output_processor.abort(i) for i in ids) if o is not None]
        self._log_stats(outputs)
        self._deliver(outputs)
        if self._dead is None:
            self._send(("abort", ids))

    def prepare_structured_outputs(self) -> concurrent.futures.Future[Any]:
        if self._structured_ready is None:
            self._structured_ready = self._utility("prepare_structured")
        return self._structured_ready

    async def check_structured_outputs(self, params: SamplingParams) -> None:
        if params.structured_outputs is None:
            return
        await asyncio.wrap_future(self.prepare_structured_outputs())
        await asyncio.wrap_future(self._utility("compile", params.structured_outputs))

    async def call_in_core(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(engine_core)`` in the core process between steps; its result. ``fn`` and
        the result travel pickled (a module-level function, plain data)."""
        self._attach()
        self._check_running()
        return await asyncio.wrap_future(self._utility("call", fn))

    async def _in_core(self, fn: Callable[[Any], Any]) -> Any:
        return await self.call_in_core(fn)

    def _utility(self, name: str, *args: Any) -> concurrent.futures.Future[Any]:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        if self._dead is not None:
            fut.set_exception(EngineDeadError(self._dead))
            return fut
        call_id = next(self._call_ids)
        self._calls[call_id] = fut
        self._send(("utility", call_id, name, args))
        return fut

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the core process; requests still running get an EngineDeadError."""
        if self._stopping:
            return
        self._stopping = True
        loop = self._loop
        if loop is not None and not loop.is_closed() and threading.get_ident() == self._loop_thread:
            loop.remove_reader(self.core.chan.sock.fileno())
            loop.remove_writer(self.core.chan.sock.fileno())
            self._fail_all(EngineDeadError("the engine was shut down."))
        if self.core.chan.sock.fileno() >= 0:  # (closed already where the start failed)
            self.core.chan.sock.setblocking(True)
        self.core.shutdown(timeout)

    # ------------------------------------------------------------------ transport

    def wake(self) -> None:
        """End the core's idle wait (expert parallelism over data-parallel cores: another
        core got a request, whose steps this core must join)."""
        self._send(("wake",))

    def _send(self, msg: Any) -> None:
        """Queue one message to the core and write what the socket takes now. Before a loop
        is bound (start-up), a blocking write."""
        data = encode(msg)
        if self._loop is None:
            self.core.chan.send_bytes(data)
            return
        self._wbuf += Channel.frame(data)
        if not self._writing:
            self._flush()

    def _flush(self) -> None:
        sock = self.core.chan.sock
        try:
            n = sock.send(self._wbuf)
        except BlockingIOError:
            n = 0
        except OSError:  # the core is gone; the reader sees the end of file
            self._wbuf.clear()
            n = 0
        del self._wbuf[:n]
        assert self._loop is not None
        if self._wbuf and not self._writing:
            self._loop.add_writer(sock.fileno(), self._flush)
            self._writing = True
        elif not self._wbuf and self._writing:
            self._loop.remove_writer(sock.fileno())
            self._writing = False

    def _on_readable(self) -> None:
        clock = self._clock
        clock.lap("rest of the event loop")
        try:
            data = self.core.chan.sock.recv(_READ_SIZE)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._core_died()
            return
        # the steps that arrived together are processed together: one output per request
        # (its tokens of all those steps) instead of one per step, when this loop lags
        outs: list[tuple] = []
        stats = None
        for msg in self.core.chan.feed(data):
            if msg[0] == "out":
                outs += msg[1]
                stats = msg[2]
                clock.count += 1
                continue
            if stats is not None:
                self._outputs(outs, stats)
                outs, stats = [], None
            try:
                self._handle(msg)
            except Exception:  # a bug in handling one message must not stop the reader
                logger.exception("handling the engine core's %r message failed", msg[0])
        if stats is not None:
            self._outputs(outs, stats)
        clock.lap("core messages")

    def _outputs(self, packed: list[tuple], stats: dict[str, Any]) -> None:
        """Detokenize, check stop strings, log stats, deliver to the streams."""
        try:
            outputs, stopped, failed = self.output_processor.process_outputs(unpack_outputs(packed))
            if stopped:
                self._send(("stop", stopped))
            if failed:  # their output could not be made: end them in the core
                self._send(("abort", failed))
            self._stats = stats
            self._log_stats(outputs)
            self._deliver(outputs)
            self._stats["num_streams"] = len(self._streams)
        except Exception:  # a bug here must not stop the reader
            logger.exception("processing the engine core's outputs failed")

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "reply":
            _, call_id, ok, value = msg
            fut = self._calls.pop(call_id, None)
            if fut is None or not fut.set_running_or_notify_cancel():
                return
            if ok:
                fut.set_result(value)
            else:  # the caller's mistake (a bad grammar) is a ValueError, as in-thread
                etype, message = value
                caller = etype == "ValueError"
                fut.set_exception(ValueError(message) if caller else EngineError(message))
        elif kind == "step_error":
            # the core ended these requests (EngineCore.step_failed); the others run on. Dead:
            # the core exits next; its end of file fails the rest, with this reason
            _, message, ids, dead = msg
            if dead:
                self._dead_reason = message
            self._fail(ids, EngineDeadError(message) if dead else EngineError(message))
        else:
            logger.error("unknown message from the engine core: %r", kind)

    def _log_stats(self, outputs: list[RequestOutput]) -> None:
        for log in self.stat_loggers:  # before delivery, as the in-thread engine does
            try:
                log(self._stats, outputs)
            except Exception:  # a metrics bug must not stop the engine
                logger.exception("stat logger failed")

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        streams = self._streams
        items = []
        for out in outputs:
            stream = streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del streams[out.request_id]
            items.append((stream, out))
        put_all(items)  # first outputs first

    def _fail(self, request_ids: list[str], err: BaseException) -> None:
        """End these requests' streams with ``err`` (ids unknown here are ignored)."""
        for rid in request_ids:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                self.output_processor.abort(rid)
                stream.put(err)

    def _fail_all(self, err: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for rid, stream in streams.items():
            self.output_processor.abort(rid)
            stream.put(err)

    def _core_died(self) -> None:
        code = self.core.wait_exit(5.0)
        self._dead = f"the engine core process (pid {self.core.pid}) exited (exit code {code})."
        if self._dead_reason is not None:
            self._dead = f"{self._dead_reason}; {self._dead}"
        if not self._stopping:
            logger.error("%s Failing every request in flight.", self._dead)
        assert self._loop is not None
        sock = self.core.chan.sock
        self._loop.remove_reader(sock.fileno())
        if self._writing:
            self._loop.remove_writer(sock.fileno())
            self._writing = False
        self._fail_all(EngineDeadError(self._dead))
        calls, self._calls = self._calls, {}
        for fut in calls.values():
            if fut.set_running_or_notify_cancel():
                fut.set_exception(EngineDeadError(self._dead))
        if not self._stopping:
            for cb in self.on_dead:
                try:
                    cb(self._dead)
                except Exception:
                    logger.exception("on_dead callback failed")
