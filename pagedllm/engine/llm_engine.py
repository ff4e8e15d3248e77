"""LLMEngine: the synchronous front end (tokenize -> EngineCore -> detokenize)."""

from __future__ import annotations

import itertools
from typing import Any

from pagedllm.beam_search import BeamSearchParams
from pagedllm.config import EngineArgs, EngineConfig
from pagedllm.engine.core import EngineCore, StepFailure
from pagedllm.engine.input_processor import InputProcessor, PromptType
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.lora.request import LoRARequest
from pagedllm.model.loader import load_tokenizer
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams, beam_sampling_params


class LLMEngine:
    """Adds requests, steps the core, returns RequestOutputs. Used by ``LLM`` and the server."""

    def __init__(self, config: EngineConfig, tokenizer: Any = None) -> None:
        if config.parallel_config.data_parallel_size > 1:
            raise ValueError(
                "data_parallel_size > 1 runs several engine core processes (LLM(...) and "
                "pagedllm serve --data-parallel-size N); an in-process engine runs one."
            )
        self.config = config
        mc = config.model_config
        if tokenizer is None:
            tokenizer = load_tokenizer(
                mc.model, mc.tokenizer if mc.tokenizer != mc.model else None, mc.load_format
            )
        self.tokenizer = tokenizer
        self.input_processor = InputProcessor(
            mc, tokenizer, config.kvc_config.enabled, config.lora_config is not None
        )
        eos = self.input_processor.eos_token_id
        self.engine_core = EngineCore(config, {eos} if eos is not None else set(), tokenizer)
        self.output_processor = OutputProcessor(tokenizer, config.cache_config.kv_transfer)
        self._ids = itertools.count()
        # process a step's outputs during the next one (see step); LLM.generate turns it on
        self.defer_outputs = False
        self._deferred: list = []  # core outputs not yet processed

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args.create_engine_config())

    def next_request_id(self) -> str:
        return str(next(self._ids))

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        priority: int = 0,
        output_kind: str = "final",
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Validate and queue one request (``lora_request``: its LoRA adapter, None for the
        base model). Raises ValueError (nothing queued) on bad input."""
        if self.output_processor.has(request_id):
            raise ValueError(f"request_id {request_id!r} is already in use.")
        request, text = self.input_processor.process(
            request_id, prompt, params, priority, lora_request=lora_request
        )
        self.engine_core.add_request(request)
        self.output_processor.add_request(
            request_id, text, request.prompt_token_ids, request.sampling_params, output_kind
        )

    def add_beam_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: BeamSearchParams,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a beam search; its one RequestOutput (when it ends) has a CompletionOutput per
        hypothesis, best first. ``lora_request``: the adapter every beam runs with."""
        if self.output_processor.has(request_id):
            raise ValueError(f"request_id {request_id!r} is already in use.")
        sp = beam_sampling_params(params)
        request, text = self.input_processor.process(
            request_id, prompt, sp, lora_request=lora_request
        )
        eos = self.input_processor.eos_token_id
        self.engine_core.add_beam_request(request, params, {eos} if eos is not None else set())
        self.output_processor.add_request(request_id, text, request.prompt_token_ids, sp)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load and list a LoRA adapter (``EngineCore.add_lora``); False if already loaded."""
        return self.engine_core.add_lora(lora_request)

    def remove_lora(self, lora: int | str) -> bool:
        """Unlist a LoRA adapter by id or name (``EngineCore.remove_lora``)."""
        return self.engine_core.remove_lora(lora)

    def list_loras(self) -> list[LoRARequest]:
        """The listed LoRA adapters, by id."""
        return self.engine_core.list_loras()

    def check_structured_outputs(self, params: SamplingParams) -> None:
        """Compile a request's grammar now (cached for when it runs); ValueError with the
        compiler's message if it is invalid."""
        if params.structured_outputs is not None:
            self.engine_core.structured_output_manager().compile_now(params.structured_outputs)

    def abort_request(self, request_ids: list[str] | str) -> list[RequestOutput]:
        """Abort requests; returns their final outputs (finish_reason 'abort')."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        self.engine_core.abort_requests(request_ids)
        outs = [self.output_processor.abort(rid) for rid in request_ids]
        return [o for o in outs if o is not None]

    def has_unfinished_requests(self) -> bool:
        return bool(self._deferred) or self.engine_core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """One engine iteration; the outputs of requests that progressed (or finished).

        With ``defer_outputs`` (``LLM.generate``) and async scheduling, a step's outputs are
        detokenized during the next iteration, while the device runs the step that iteration
        launched (``EngineCore.step``'s ``after_launch``), not between the previous step's
        tokens and the launch of the next: that work leaves the host's critical path. The
        price: outputs come out one iteration later, and a sequence that hits a stop string
        is computed for one more step (its extra tokens are dropped)."""
        if not (self.defer_outputs and self.engine_core.async_scheduling):
            return self._process(self.engine_core.step())
        pending, self._deferred = self._deferred, []
        results: list[RequestOutput] = []

        def process_pending() -> None:
            results.extend(self._process(pending))
            pending.clear()

        try:
            self._deferred = self.engine_core.step(process_pending if pending else None)
        except BaseException:
            self._deferred = pending  # not processed yet (empty if they were)
            raise
        if pending:  # nothing was launched (or a grammar step waited): process them now
            process_pending()
        return results

    def _process(self, core_outputs: list) -> list[RequestOutput]:
        outputs, stopped, failed = self.output_processor.process_outputs(core_outputs)
        if stopped:
            self.engine_core.finish_requests_stopped(stopped)
        if failed:  # their output could not be made (detokenizer): end them, free their blocks
            self.engine_core.abort_requests(failed)
        return outputs

    def step_failed(self, error: BaseException) -> StepFailure:
        """Recover from a ``step()`` that raised (``EngineCore.step_failed``); the ended
        requests are forgotten here too (their callers get ``StepFailure.message``)."""
        failure = self.engine_core.step_failed(error)
        for rid in failure.request_ids:
            self.output_processor.abort(rid)
        return failure

    def get_tokenizer(self) -> Any:
        return self.tokenizer
