"""DPLLMEngine: the offline API (``LLM(..., data_parallel_size=N)``) over N engine cores.

``LLM`` drives an engine through ``LLMEngine``'s interface (add requests, ``step()`` until
none is unfinished). With ``data_parallel_size`` > 1 this class gives that interface over a
``DPAsyncLLM`` - the same N engine core processes, router and merged stats the server uses
(engine/dp_async_llm.py) - run on an event loop in a thread of its own: ``add_request``
queues a request there (bad input raises here, before anything is queued), a task per request
waits for its final output, and ``step()`` hands back the outputs that finished since the last
call, waiting for at least one. The cores step on their own; ``step()`` only collects.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import weakref
from collections.abc import Coroutine
from typing import Any

from pagedllm.beam_search import BeamSearchParams
from pagedllm.config import EngineArgs, EngineConfig
from pagedllm.engine.input_processor import PromptType
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams


class DPLLMEngine:
    """``LLMEngine``'s interface for ``LLM`` over N data-parallel engine cores (see the module
    docstring)."""

    def __init__(self, config: EngineConfig) -> None:
        from pagedllm.engine.dp_async_llm import DPAsyncLLM

        self.config = config
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="pagedllm-dp-llm", daemon=True
        )
        self._thread.start()
        try:
            self.llm = DPAsyncLLM(config)
        except BaseException:
            _stop_loop(self._loop, self._thread)
            raise
        self._run(self.llm.start())
        self.tokenizer = self.llm.tokenizer
        self.input_processor = self.llm.input_processor
        # what LLM.get_metrics reads: the cores' merged stats
        self.engine_core = self.llm
        self._ids = itertools.count()
        self._pending: set[str] = set()
        self._done: queue.Queue[tuple[str, RequestOutput | BaseException]] = queue.Queue()
        self._finalizer = weakref.finalize(self, _shutdown, self.llm, self._loop, self._thread)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> DPLLMEngine:
        """Start the N engine core processes (each loads the model: slow)."""
        return cls(args.create_engine_config())

    def _run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run ``coro`` on the engine's loop and wait for its result (or exception)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def next_request_id(self) -> str:
        return str(next(self._ids))

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        priority: int = 0,
        output_kind: str = "final",
    ) -> None:
        """Validate and queue one request (on the least loaded core, or the one holding its
        prefix). Raises ValueError (nothing queued) on bad input. Only final outputs."""
        if output_kind != "final":
            raise ValueError("the offline data-parallel engine returns final outputs only.")
        if request_id in self._pending:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        stream = self._run(self.llm.add_request(prompt, params, request_id, priority, "final"))
        self._follow(request_id, stream)

    def add_beam_request(
        self, request_id: str, prompt: PromptType, params: BeamSearchParams
    ) -> None:
        """Queue a beam search; its one RequestOutput has a CompletionOutput per hypothesis."""
        if request_id in self._pending:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        stream = self._run(self.llm.add_beam_request(prompt, params, request_id))
        self._follow(request_id, stream)

    def _follow(self, request_id: str, stream: Any) -> None:
        """A task on the loop that puts the request's final output (or error) in ``_done``."""
        self._pending.add(request_id)

        async def drain() -> None:
            last: RequestOutput | BaseException | None = None
            try:
                async for out in stream:
                    last = out
            except BaseException as e:  # noqa: BLE001 - handed to the caller of step()
                last = e
            if last is None:
                last = RuntimeError(f"request {request_id} ended without an output")
            self._done.put((request_id, last))

        asyncio.run_coroutine_threadsafe(drain(), self._loop)

    def check_structured_outputs(self, params: SamplingParams) -> None:
        """Compile a request's grammar now; ValueError with the compiler's message if invalid."""
        if params.structured_outputs is not None:
            self._run(self.llm.check_structured_outputs(params))

    def abort_request(self, request_ids: list[str] | str) -> list[RequestOutput]:
        """Abort requests (their blocks are freed in their cores); no outputs come back."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        self.llm.abort_nowait(request_ids)
        self._pending.difference_update(request_ids)
        return []

    def has_unfinished_requests(self) -> bool:
        return bool(self._pending)

    def step(self) -> list[RequestOutput]:
        """The outputs of requests that finished since the last call (at least one: waits).
        A request that failed raises its error here."""
        items = [self._done.get()]
        while True:
            try:
                items.append(self._done.get_nowait())
            except queue.Empty:
                break
        outs: list[RequestOutput] = []
        error: BaseException | None = None
        for rid, item in items:
            if rid not in self._pending:  # aborted meanwhile
                continue
            self._pending.discard(rid)
            if isinstance(item, BaseException):
                error = error or item
            else:
                outs.append(item)
        if error is not None:
            raise error
        return outs

    def step_failed(self, error: BaseException) -> None:
        """Nothing to recover here: a failed request failed in its own core (``LLM`` aborts
        the rest of its call)."""

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def shutdown(self) -> None:
        """Stop the engine core processes and the loop thread."""
        self._finalizer()


def _stop_loop(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)
    if not thread.is_alive():
        loop.close()


def _shutdown(llm: Any, loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    """Shut the cores down on the loop's thread (where their sockets are read, so their
    streams end with an error), then stop the loop."""

    async def stop() -> None:
        llm.shutdown()

    try:
        if thread.is_alive() and loop.is_running():
            asyncio.run_coroutine_threadsafe(stop(), loop).result(timeout=60)
        else:
            llm.shutdown()
    finally:
        _stop_loop(loop, thread)
