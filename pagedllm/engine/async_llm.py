"""AsyncLLMBase, and AsyncLLM: an asyncio front for ``LLMEngine`` whose loop runs on one
background thread of this process (``pagedllm serve --no-engine-process``; the server's
default is ``MPAsyncLLM``, the engine core in a process of its own: ``mp_async_llm.py``).

The engine is not thread-safe, so exactly one thread (``pagedllm-engine``) touches it: it
takes commands (add, abort, call) from a queue, runs ``LLMEngine.step()`` while work is
pending, and hands each step's delta outputs to per-request ``asyncio.Queue``s on the
server's event loop with ONE ``loop.call_soon_threadsafe`` per step. When idle it sleeps on a
``threading.Condition`` (no busy loop). The asyncio thread does HTTP parsing, chat templates,
tokenization, validation, JSON and SSE framing.

Why it is not the server's default: the two threads share one interpreter lock. Where a step
is slow (a CPU), the HTTP thread's work per streamed token is small beside it and a thread is
the cheaper choice; on a GPU, where a step of hundreds of requests takes a few ms, the HTTP
thread's work per token is comparable to the engine's and the two wait for each other, so the
server falls well short of the engine's own throughput in this mode and matches it with the
engine core process (the server-against-engine GPU benchmark in ``benchmarks/README.md``).

Failure isolation: a request that fails validation raises ``ValueError`` in the caller before
any output is streamed (``add_request`` validates synchronously in the caller's thread, then the
engine thread reports the engine's own checks back through a future). An exception inside
``LLMEngine.step()`` ends the requests that step may have left wrong (``EngineCore.step_failed``:
the running ones; those still waiting for their first step stay), their streams raise
``EngineError``, and the loop goes on serving. After ``MAX_CONSECUTIVE_STEP_FAILURES`` failed
steps in a row the engine is dead: every stream raises ``EngineDeadError``, ``is_running``
turns False (``/health`` answers 503) and the thread ends. A request whose output cannot be
made (its detokenizer raised) ends alone, with ``RequestOutput.error`` set.

Structured outputs: the grammar manager (xgrammar tokenizer info and compiler) is created once,
on a helper thread (``prepare_structured_outputs``), never on the event loop nor the engine
thread; every structured request waits for it before it is queued, so the engine thread never
creates a second one. ``check_structured_outputs`` compiles a request's grammar on an executor
thread (the result is cached for when the request runs) so a bad grammar is a ``ValueError``
before the request is queued.

Beam search (``add_beam_request``) runs on the same engine thread; its stream yields one
``RequestOutput`` at the end, whose outputs are the hypotheses, best first.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from pagedllm.beam_search import BeamSearchParams
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.config import EngineArgs, EngineConfig
    from pagedllm.engine.input_processor import InputProcessor
    from pagedllm.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

# Called on the engine thread after each iteration with (engine stats, outputs of the iteration).
StatLogger = Callable[[dict[str, Any], list[RequestOutput]], None]


class EngineError(RuntimeError):
    """The engine failed while running this request (the request has been aborted)."""


class EngineDeadError(RuntimeError):
    """The engine is not running (shut down, never started, or dead after failed steps)."""

    status_code = 503  # over HTTP: the service is unavailable, not this request's fault


#: Outputs a stream keeps unread before merging them into one: a client that does not read
#: holds at most this many objects, plus its request's own text, token ids and logprobs.
MAX_UNREAD_OUTPUTS = 64


class RequestStream:
    """Async iterator over one request's delta ``RequestOutput``s; ends after ``finished``.

    Deltas that queued up while the consumer was busy are merged into one output, so a slow
    client gets fewer, larger chunks instead of falling behind; one that does not read at all
    holds at most ``MAX_UNREAD_OUTPUTS`` of them (more are merged as they come). Nothing
    waits for the consumer: the request runs to its end whoever reads.
    """

    def __init__(
        self, request_id: str, owner: AsyncLLMBase, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.request_id = request_id
        self.loop = loop
        self.finished = False
        self._owner = owner
        # unread outputs, then at most one error (nothing is kept after an error or a
        # finished output: the consumer stops there)
        self._items: deque[RequestOutput | BaseException] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._pending_error: BaseException | None = None
        self.delivered = False  # anything put yet (``put_all`` hands first outputs out first)

    def put(self, item: RequestOutput | BaseException) -> None:
        """Event-loop side: enqueue one output (or an error to raise in the consumer)."""
        self.delivered = True
        items = self._items
        if items:
            last = items[-1]
            if isinstance(last, BaseException) or last.finished:
                return  # the consumer ends before it
        items.append(item)
        if len(items) > MAX_UNREAD_OUTPUTS:
            error = items[-1] if isinstance(items[-1], BaseException) else None
            outs = [i for i in items if isinstance(i, RequestOutput)]
            items.clear()
            items.append(merge_deltas(*outs))
            if error is not None:
                items.append(error)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    @property
    def num_unread(self) -> int:
        """Outputs (and errors) queued that the consumer has not taken."""
        return len(self._items)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._pending_error is not None:
            err, self._pending_error = self._pending_error, None
            self.finished = True
            raise err
        if self.finished:
            raise StopAsyncIteration
        items = self._items
        while not items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = items.popleft()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if items:  # everything that queued up, as one output
            batch = [item]
            while items:
                nxt = items.popleft()
                if isinstance(nxt, BaseException):
                    self._pending_error = nxt
                    break
                batch.append(nxt)
            item = merge_deltas(*batch)
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        """Abort the request if it is still running (safe to call from ``finally`` blocks)."""
        if not self.finished:
            self.finished = True
            self._owner.abort_nowait(self.request_id)


def merge_deltas(*outputs: RequestOutput) -> RequestOutput:
    """One delta output equivalent to ``outputs`` in order (the same request; completions are
    matched by ``index``, so parallel sampling merges too), in time linear in their size."""
    if len(outputs) == 1:
        return outputs[0]
    parts: dict[int, list[CompletionOutput]] = {}
    for out in outputs:
        for c in out.outputs:
            parts.setdefault(c.index, []).append(c)
    merged: list[CompletionOutput] = []
    for index in sorted(parts):
        cs = parts[index]
        if len(cs) == 1:
            merged.append(cs[0])
            continue
        logprobs = None
        if any(c.logprobs is not None for c in cs):
            logprobs = [lp for c in cs for lp in (c.logprobs or [])]
        merged.append(
            dataclasses.replace(
                cs[-1],
                text="".join(c.text for c in cs),
                token_ids=[t for c in cs for t in c.token_ids],
                logprobs=logprobs,
            )
        )
    prompt_logprobs = None
    for out in reversed(outputs):
        if out.prompt_logprobs is not None:
            prompt_logprobs = out.prompt_logprobs
            break
    return dataclasses.replace(outputs[-1], outputs=merged, prompt_logprobs=prompt_logprobs)


@dataclasses.dataclass
class _Add:
    stream: RequestStream
    prompt: dict[str, Any]
    params: SamplingParams | BeamSearchParams
    priority: int
    done: concurrent.futures.Future[None]
    output_kind: str = "delta"
    lora_request: LoRARequest | None = None


@dataclasses.dataclass
class _Abort:
    request_ids: list[str]


@dataclasses.dataclass
class _Call:
    fn: Callable[[LLMEngine], Any]
    done: concurrent.futures.Future[Any]


class AsyncLLMBase:
    """What the server needs of an engine, whatever runs it: validation, request streams,
    aborts, stats. ``AsyncLLM`` runs the engine on a thread of this process;
    ``MPAsyncLLM`` (``engine/mp_async_llm.py``) talks to an engine core process.

    Use ``add_request`` (validates, returns a ``RequestStream``) or ``generate`` (an async
    generator of delta outputs). ``stats()`` is a snapshot of the scheduler's numbers as of
    the last engine iteration.
    """

    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Any,
        input_processor: InputProcessor,
        stat_loggers: list[StatLogger] | None = None,
    ) -> None:
        self.config = config
        self.model_config = config.model_config
        self.tokenizer = tokenizer
        self.input_processor = input_processor
        self.stat_loggers: list[StatLogger] = list(stat_loggers or [])
        self._stats: dict[str, Any] = {}
        self._ids = 0

    @property
    def is_running(self) -> bool:
        """True while the engine is alive and accepting work."""
        raise NotImplementedError

    async def start(self) -> None:
        """Bind to the running event loop (the server calls it at start-up)."""

    def new_request_id(self, prefix: str = "req") -> str:
        self._ids += 1
        return f"{prefix}-{self._ids}"

    def validate(
        self, prompt: Any, params: SamplingParams, lora_request: LoRARequest | None = None
    ) -> tuple[str | None, list[int]]:
        """Tokenize and check one prompt in the caller's thread: (prompt text, token ids).
        Raises ValueError naming the field. (The input processor only reads the tokenizer.)"""
        req, text = self.input_processor.process(
            "validate", prompt, params, lora_request=lora_request
        )
        return text, list(req.prompt_token_ids)

    async def add_request(
        self,
        prompt: Any,
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        output_kind: str = "delta",
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Validate and queue a request; returns its output stream.

        ``prompt`` may be a dict with a ``cache_salt`` (a string isolating this tenant's
        prefix-cache entries). ``output_kind`` "delta" (default) streams what each step added;
        "final" yields one output at the end (for ``best_of > n``: the n best, re-indexed).
        ``lora_request``: the LoRA adapter to run it with (None: the base model); one not
        loaded yet is loaded when the request reaches the engine.
        Raises ValueError (nothing queued) on bad input, EngineDeadError if the engine stopped.
        """
        if output_kind not in ("delta", "final"):
            raise ValueError(f"output_kind must be 'delta' or 'final', got {output_kind!r}.")
        self._check_running()
        text, ids = self.validate(prompt, params, lora_request)
        if params.structured_outputs is not None:
            await asyncio.wrap_future(self.prepare_structured_outputs())
        return await self._queue(
            prompt, text, ids, params, request_id, priority, output_kind, lora_request
        )

    async def add_beam_request(
        self,
        prompt: Any,
        params: BeamSearchParams,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Validate and queue a beam search; its stream yields ONE ``RequestOutput`` when the
        search ends, whose outputs are the hypotheses, best first (``index`` 0, 1, ...).
        ``lora_request``: the adapter every beam runs with."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be BeamSearchParams, got {type(params).__name__}.")
        self._check_running()
        sp = SamplingParams(max_tokens=params.max_tokens)
        text, ids = self.validate(prompt, sp, lora_request)
        return await self._queue(prompt, text, ids, params, request_id, 0, "final", lora_request)

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
        """Hand a validated request to the engine; its stream."""
        raise NotImplementedError

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load and list a LoRA adapter in the engine (between steps); False if it is already
        loaded. ValueError naming the adapter if it cannot be used."""
        return await self._in_core(partial(_add_lora, lora_request))

    async def remove_lora(self, lora: int | str) -> bool:
        """Unlist a LoRA adapter by id or name; False if none is listed so. Its weights are
        freed once no running request uses it."""
        return await self._in_core(partial(_remove_lora, lora))

    async def list_loras(self) -> list[LoRARequest]:
        """The engine's listed LoRA adapters, by id."""
        return await self._in_core(_list_loras)

    async def _in_core(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(engine_core)`` run by the engine between steps; its result."""
        raise NotImplementedError

    async def call_in_cores(self, fn: Callable[[Any], Any]) -> list[Any]:
        """``fn(engine_core)`` run by every engine core between its steps (one core, or each
        data-parallel core in order); the results. ``fn`` must be a module-level function and
        its result plain data: a core in another process gets and returns them pickled."""
        return [await self._in_core(fn)]

    def prepare_structured_outputs(self) -> concurrent.futures.Future[Any]:
        """Create the engine's grammar manager off the event loop and the engine loop (once;
        idempotent): a Future that resolves when it is ready. Its exception is a ValueError
        when structured outputs are unavailable (no xgrammar). Call it at start-up to have the
        tokenizer info ready before the first structured request."""
        raise NotImplementedError

    async def check_structured_outputs(self, params: SamplingParams) -> None:
        """Compile the request's grammar now, off the event loop and off the engine loop
        (cached for when the request runs). ValueError with the compiler's message if it is
        invalid; a no-op without structured outputs."""
        raise NotImplementedError

    async def generate(
        self,
        prompt: Any,
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Delta outputs of one request (``lora_request``: its LoRA adapter). Raises
        ValueError at the first ``__anext__`` (before any output) on bad input. Closing the
        generator early aborts the request."""
        stream = await self.add_request(
            prompt, params, request_id, priority, lora_request=lora_request
        )
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    async def abort(self, request_id: str | list[str]) -> None:
        """Abort requests (unknown or finished ids are ignored); their blocks are freed."""
        self.abort_nowait(request_id)

    def abort_nowait(self, request_id: str | list[str]) -> None:
        """``abort`` without awaiting: usable from any thread and from ``finally`` blocks."""
        raise NotImplementedError

    def stats(self) -> dict[str, Any]:
        """Snapshot as of the last iteration: scheduler stats plus num_free_blocks, num_blocks,
        num_streams (requests the front still tracks)."""
        return dict(self._stats)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine; requests still running get an EngineDeadError."""
        raise NotImplementedError

    def _check_running(self) -> None:
        if not self.is_running:
            raise EngineDeadError("the engine is not running.")


def _add_lora(lora_request: LoRARequest, core: Any) -> bool:
    return core.add_lora(lora_request)


def _remove_lora(lora: int | str, core: Any) -> bool:
    return core.remove_lora(lora)


def _list_loras(core: Any) -> list[LoRARequest]:
    return core.list_loras()


def cache_salt_of(prompt: Any, params: SamplingParams | BeamSearchParams) -> str | None:
    """The prompt's ``cache_salt`` (checked), or None."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None:
        if not isinstance(salt, str) or not salt:
            raise ValueError("cache_salt must be a non-empty string.")
        if isinstance(params, BeamSearchParams):
            raise ValueError("cache_salt is not supported with beam search.")
    return salt


class AsyncLLM(AsyncLLMBase):
    """Serves many concurrent asyncio callers from one ``LLMEngine`` on a background thread
    of this process (see the module docstring)."""

    def __init__(self, engine: LLMEngine, stat_loggers: list[StatLogger] | None = None) -> None:
        super().__init__(engine.config, engine.tokenizer, engine.input_processor, stat_loggers)
        self.engine = engine
        self._cond = threading.Condition()
        self._commands: deque[_Add | _Abort | _Call] = deque()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._stopping = False
        self._dead_error: BaseException | None = None
        self._stats = self._collect_stats()
        self._structured_lock = threading.Lock()
        self._structured_ready: concurrent.futures.Future[Any] | None = None
        self._thread = threading.Thread(target=self._run, name="pagedllm-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(
        cls, args: EngineArgs, stat_loggers: list[StatLogger] | None = None
    ) -> AsyncLLM:
        """Build the engine (loads the model: slow) and start its thread."""
        from pagedllm.engine.llm_engine import LLMEngine

        return cls(LLMEngine.from_engine_args(args), stat_loggers)

    # ----------------------------------------------------------------- caller (asyncio) side

    @property
    def is_running(self) -> bool:
        """True while the engine thread is alive and accepting work."""
        return self._thread.is_alive() and not self._stopping

    def _check_running(self) -> None:
        if not self.is_running:
            dead = self._dead_error
            why = f": {dead}" if isinstance(dead, EngineDeadError) else "."
            raise EngineDeadError(f"the engine is not running{why}") from dead

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
        request_id = request_id or self.new_request_id()
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, self, loop)
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        engine_prompt: dict[str, Any] = {"prompt": text, "prompt_token_ids": ids}
        salt = cache_salt_of(prompt, params)
        if salt is not None:
            engine_prompt["cache_salt"] = salt
        self._submit(_Add(stream, engine_prompt, params, priority, done, output_kind, lora_request))
        try:
            await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            self.abort_nowait(request_id)
            raise
        return stream

    def prepare_structured_outputs(self) -> concurrent.futures.Future[Any]:
        with self._structured_lock:
            if self._structured_ready is None:
                fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
                self._structured_ready = fut
                core = self.engine.engine_core

                def create() -> None:
                    try:
                        fut.set_result(core.structured_output_manager())
                    except BaseException as e:  # noqa: BLE001 - handed to the waiters
                        logger.warning("structured outputs unavailable: %s", e)
                        fut.set_exception(e if isinstance(e, ValueError) else ValueError(str(e)))

                threading.Thread(target=create, name="pagedllm-grammar-init", daemon=True).start()
            return self._structured_ready

    async def check_structured_outputs(self, params: SamplingParams) -> None:
        if params.structured_outputs is None:
            return
        await asyncio.wrap_future(self.prepare_structured_outputs())
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.engine.check_structured_outputs, params)

    def abort_nowait(self, request_id: str | list[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        if self._thread.is_alive():
            self._submit(_Abort(ids))

    async def _in_core(self, fn: Callable[[Any], Any]) -> Any:
        return await self.call_in_engine(lambda engine: fn(engine.engine_core))

    async def call_in_engine(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread between steps; returns its result."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running.")
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._submit(_Call(fn, done))
        return await asyncio.wrap_future(done)

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _submit(self, cmd: _Add | _Abort | _Call) -> None:
        with self._cond:
            if self._stopping:
                if isinstance(cmd, (_Add, _Call)) and cmd.done.set_running_or_notify_cancel():
                    cmd.done.set_exception(EngineDeadError("the engine is not running."))
                return
            self._commands.append(cmd)
            self._cond.notify()

    # --------------------------------------------------------------------- engine thread side

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while (
                        not self._commands
                        and not self._stopping
                        and not self.engine.has_unfinished_requests()
                    ):
                        self._cond.wait()
                    if self._stopping:
                        break
                    commands = list(self._commands)
                    self._commands.clear()
                outputs: list[RequestOutput] = []
                for cmd in commands:
                    outs = self._handle(cmd)
                    self._deliver(outs)  # aborted streams end (and are untracked) at once
                    outputs.extend(outs)
                step_outputs = self._step() if self.engine.has_unfinished_requests() else []
                outputs.extend(step_outputs)
                self._stats = self._collect_stats()
                for log in self.stat_loggers:  # before delivery: a client that got its last
                    try:  # token and then reads /metrics sees its request counted
                        log(self._stats, outputs)
                    except Exception:  # a metrics bug must not stop the engine
                        logger.exception("stat logger failed")
                self._deliver(step_outputs)
                self._stats = {**self._stats, "num_streams": len(self._streams)}
        except BaseException as e:  # pragma: no cover - only on bugs in this loop itself
            logger.exception("engine thread died")
            self._dead_error = e
        finally:
            with self._cond:
                self._stopping = True
                dead = self._dead_error
                if not isinstance(dead, EngineDeadError):
                    dead = EngineDeadError("the engine was shut down.")
                self._fail_all(dead)
            self.engine.engine_core.shutdown()  # the grammar worker process, if any

    def _handle(self, cmd: _Add | _Abort | _Call) -> list[RequestOutput]:
        if isinstance(cmd, _Abort):
            ids = [i for i in cmd.request_ids if i in self._streams]
            if not ids:
                return []
            try:
                return self.engine.abort_request(ids)
            except Exception:
                logger.exception("abort of %s failed", ids)
                return []
        if isinstance(cmd, _Call):
            if cmd.done.set_running_or_notify_cancel():
                try:
                    cmd.done.set_result(cmd.fn(self.engine))
                except Exception as e:
                    cmd.done.set_exception(e)
            return []
        rid = cmd.stream.request_id
        if not cmd.done.set_running_or_notify_cancel():
            return []
        try:
            if rid in self._streams:
                raise ValueError(f"request_id {rid!r} is already in use.")
            if isinstance(cmd.params, BeamSearchParams):
                self.engine.add_beam_request(rid, cmd.prompt, cmd.params, cmd.lora_request)
            elif "cache_salt" in cmd.prompt:
                self._add_salted(rid, cmd)
            else:
                self.engine.add_request(
                    rid, cmd.prompt, cmd.params, cmd.priority, cmd.output_kind, cmd.lora_request
                )
        except Exception as e:  # ValueError from validation, or anything else: this request only
            cmd.done.set_exception(e)
            return []
        self._streams[rid] = cmd.stream
        cmd.done.set_result(None)
        return []

    def _add_salted(self, rid: str, cmd: _Add) -> None:
        """``LLMEngine.add_request`` for a prompt with a ``cache_salt``, setting the salt on the
        Request before the scheduler sees it (``InputProcessor.process`` does not carry it
        over; the scheduler may hash the prompt's blocks as soon as the request is queued)."""
        engine = self.engine
        assert isinstance(cmd.params, SamplingParams)
        if engine.output_processor.has(rid):
            raise ValueError(f"request_id {rid!r} is already in use.")
        request, text = engine.input_processor.process(
            rid, cmd.prompt, cmd.params, cmd.priority, lora_request=cmd.lora_request
        )
        request.cache_salt = cmd.prompt["cache_salt"]
        engine.engine_core.add_request(request)
        engine.output_processor.add_request(
            rid, text, request.prompt_token_ids, request.sampling_params, cmd.output_kind
        )

    def _step(self) -> list[RequestOutput]:
        try:
            return self.engine.step()
        except Exception as e:
            logger.exception("engine step failed")
            failure = self.engine.step_failed(e)
            if failure.dead:  # the loop ends; every stream and later request gets this
                logger.error("%s: stopping", failure.message)
                dead = EngineDeadError(failure.message)
                dead.__cause__ = e
                with self._cond:
                    self._dead_error = dead
                    self._stopping = True
                return []
            logger.error("%d requests ended by the failed step", len(failure.request_ids))
            err = EngineError(failure.message)
            err.__cause__ = e
            self._fail(failure.request_ids, err)
            return []

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        if not outputs:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Any]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            by_loop.setdefault(stream.loop, []).append((stream, out))
        for loop, items in by_loop.items():
            _call_soon(loop, put_all, items)

    def _fail(self, request_ids: list[str], err: BaseException) -> None:
        """End these requests' streams with ``err`` (raised in their consumers)."""
        failed = [(rid, self._streams.pop(rid, None)) for rid in request_ids]
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Any]]] = {}
        for _, s in failed:
            if s is not None:
                by_loop.setdefault(s.loop, []).append((s, err))
        for loop, items in by_loop.items():
            _call_soon(loop, put_all, items)

    def _fail_all(self, err: BaseException) -> None:
        streams, self._streams = self._streams, {}
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Any]]] = {}
        for s in streams.values():
            by_loop.setdefault(s.loop, []).append((s, err))
        for loop, items in by_loop.items():
            _call_soon(loop, put_all, items)
        while self._commands and self._stopping:
            cmd = self._commands.popleft()
            if isinstance(cmd, (_Add, _Call)) and cmd.done.set_running_or_notify_cancel():
                cmd.done.set_exception(EngineDeadError("the engine was shut down."))

    def _collect_stats(self) -> dict[str, Any]:
        stats = self.engine.engine_core.stats()
        stats["num_streams"] = len(getattr(self, "_streams", ()))
        return stats


def put_all(items: list[tuple[RequestStream, Any]]) -> None:
    """Put each item in its stream, the streams that have had nothing yet first: consumers
    wake in the order they are put, so a request's first token is written out before the
    running streams' next ones (under load, a first chunk waits behind none of them)."""
    firsts = [(s, item) for s, item in items if not s.delivered]
    if firsts and len(firsts) < len(items):
        items = firsts + [(s, item) for s, item in items if s.delivered]
    for stream, item in items:
        try:
            stream.put(item)
        except Exception:  # one broken consumer must not starve the others
            logger.exception("delivering output of %s failed", stream.request_id)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the consumer's loop is closed: nobody is listening any more
        pass
