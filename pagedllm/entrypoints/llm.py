"""The offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedllm.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from pagedllm.config import EngineArgs
from pagedllm.engine.input_processor import PromptType
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.lora.request import LoRARequest
from pagedllm.metrics_reader import Metric, metrics_from_stats
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams


class LLM:
    """An engine for offline batched generation, as vLLM's ``LLM``.

    Keyword arguments are engine arguments (``dtype``, ``max_model_len``, ``block_size``,
    ``max_num_seqs``, ``max_num_batched_tokens``, ``enable_chunked_prefill``, ``seed``,
    ``device``, ``kv_cache_memory_bytes``, ``speculative_config``, ``tensor_parallel_size``,
    ``data_parallel_size``, ...); an unknown one raises ValueError. With
    ``data_parallel_size`` N > 1 the requests go to N engine core processes
    (engine/dp_llm_engine.py) and only final outputs come back.
    """

    def __init__(self, model: str, **kwargs: Any) -> None:
        if "enable_kvcompress" in kwargs:  # the KV-Compress fork's name
            kwargs["enable_kvc"] = kwargs.pop("enable_kvcompress")
        unknown = set(kwargs) - EngineArgs.field_names()
        if unknown:
            raise ValueError(f"unknown engine argument(s): {sorted(unknown)}")
        self.engine_args = EngineArgs(model=model, **kwargs)
        if self.engine_args.data_parallel_size > 1:  # N engine core processes
            from pagedllm.engine.dp_llm_engine import DPLLMEngine

            self.llm_engine: Any = DPLLMEngine.from_engine_args(self.engine_args)
        else:
            self.llm_engine = LLMEngine.from_engine_args(self.engine_args)
            # offline: no one streams, so a step's outputs are detokenized while the next runs
            self.llm_engine.defer_outputs = True

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def get_metrics(self) -> list[Metric]:
        """The engine's counters and gauges under vLLM's names, as vLLM's ``LLM.get_metrics``
        (``pagedllm/metrics_reader.py``); with speculative decoding, its draft and acceptance
        counts and the mean acceptance length."""
        return metrics_from_stats(self.llm_engine.engine_core.stats())

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate completions for every prompt; results in input order. All requests are
        validated before any is queued, so a bad one raises ValueError and runs nothing.
        ``lora_request``: one LoRA adapter for every prompt, or one (or None: the base model)
        per prompt; they run in one batch."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError("sampling_params must be one object or one per prompt.")
        prios = priority or [0] * len(prompts)
        if len(prios) != len(prompts):
            raise ValueError("priority must have one entry per prompt.")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError("lora_request must be one LoRARequest or one per prompt.")
        engine = self.llm_engine
        for p, sp, lr in zip(prompts, params, loras):  # validate all first
            engine.input_processor.process("validate", p, sp, lora_request=lr)
            engine.check_structured_outputs(sp)
        for lr in dict.fromkeys(lr for lr in loras if lr is not None):  # (bad ones: here)
            engine.add_lora(lr)
        ids = [engine.next_request_id() for _ in prompts]
        for rid, p, sp, pr, lr in zip(ids, prompts, params, prios, loras):
            adapter = {"lora_request": lr} if lr is not None else {}  # (DPLLMEngine: none)
            engine.add_request(rid, p, sp, priority=pr, **adapter)
        return self._run_engine(ids, use_tqdm)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load and list a LoRA adapter (a PEFT folder), as vLLM's ``LLM.add_lora``; False if
        it is already loaded. ValueError naming the adapter if it cannot be used."""
        return self.llm_engine.add_lora(lora_request)

    def remove_lora(self, lora: int | str) -> bool:
        """Unlist a LoRA adapter by ``lora_int_id`` or ``lora_name``; False if none is listed
        so. Its weights are freed once no running request uses it."""
        return self.llm_engine.remove_lora(lora)

    def list_loras(self) -> list[LoRARequest]:
        """The listed LoRA adapters (loaded at start, by ``add_lora`` or by a request), by id."""
        return self.llm_engine.list_loras()

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        use_tqdm: bool = False,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[BeamSearchOutput]:
        """Beam search for each prompt (HF transformers' rule, see pagedllm/beam_search.py);
        beams of all prompts run together in the continuous batch, sharing blocks.
        ``lora_request``: one adapter for all prompts, or one (or None) per prompt."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        engine = self.llm_engine
        ids = [engine.next_request_id() for _ in prompts]
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"lora_request has {len(loras)} entries for {len(prompts)} prompts.")
        for rid, p, lr in zip(ids, prompts, loras):
            engine.add_beam_request(rid, p, params, lr)
        outs = self._run_engine(ids, use_tqdm)
        return [
            BeamSearchOutput(
                sequences=[
                    BeamSearchSequence(
                        c.token_ids,
                        c.cumulative_logprob or 0.0,
                        _score(c, params),
                        c.text,
                        c.finish_reason or "",
                    )
                    for c in o.outputs
                ],
                prompt_token_ids=o.prompt_token_ids,
            )
            for o in outs
        ]

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to conversations rendered with the tokenizer's chat template."""
        convs = messages if messages and isinstance(messages[0], list) else [messages]
        tok = self.get_tokenizer()
        prompts = []
        for conv in convs:
            text = tok.apply_chat_template(
                conv,
                tokenize=False,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
            )
            ids = tok.encode(text, add_special_tokens=False)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run_engine(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            while engine.has_unfinished_requests():
                try:
                    outs = engine.step()
                except BaseException as e:
                    engine.step_failed(e)  # the engine stays usable; this call raises
                    raise
                for out in outs:
                    if out.finished:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            engine.abort_request([i for i in ids if i not in results])
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[i] for i in ids]


def _score(c: object, params: BeamSearchParams) -> float:
    n = max(1, len(c.token_ids))  # type: ignore[attr-defined]
    return (c.cumulative_logprob or 0.0) / n**params.length_penalty  # type: ignore[attr-defined]
