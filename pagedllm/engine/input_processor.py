"""Turns a user's prompt and sampling parameters into a validated Request."""

from __future__ import annotations

import copy
from typing import Any

from pagedllm.config import ModelConfig
from pagedllm.core.request import Request
from pagedllm.lora.request import LoRARequest
from pagedllm.sampling_params import SamplingParams

PromptType = str | dict[str, Any] | list[int]


class InputProcessor:
    """Tokenizes, validates and clamps; every problem is a ValueError naming the field."""

    def __init__(
        self,
        model_config: ModelConfig,
        tokenizer: Any,
        kvc_enabled: bool = False,
        lora_enabled: bool = False,
    ) -> None:
        self.model_config = model_config
        self.kvc_enabled = kvc_enabled  # KV-Compress fields are accepted
        self.lora_enabled = lora_enabled  # requests may name a LoRA adapter
        self.tokenizer = tokenizer
        self.vocab_size = model_config.vocab_size
        self.eos_token_id = self._eos_id()

    def _eos_id(self) -> int | None:
        eos = getattr(self.tokenizer, "eos_token_id", None) if self.tokenizer else None
        if eos is None:
            eos = getattr(self.model_config.text_config, "eos_token_id", None)
            if isinstance(eos, list):
                eos = eos[0] if eos else None
        return eos

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids) for a string, {"prompt": ...},
        {"prompt_token_ids": [...]} or a list of ids."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("prompt dict needs 'prompt' or 'prompt_token_ids'.")
        if isinstance(prompt, str):
            if prompt == "":
                raise ValueError("prompt must not be empty.")
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass prompt_token_ids.")
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, (list, tuple)):
            return None, self._check_ids(list(prompt))
        raise ValueError(f"prompt must be a string, a token id list or a dict, got {type(prompt)}.")

    def _check_ids(self, ids: Any) -> list[int]:
        if not isinstance(ids, (list, tuple)) or len(ids) == 0:
            raise ValueError("prompt must not be empty (prompt_token_ids has no tokens).")
        # the common case in C (a map, min, max); the element-wise checks name what is wrong
        plain = set(map(type, ids)) == {int}
        if not plain and not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("prompt_token_ids must be a list of integers.")
        if plain and min(ids) >= 0 and max(ids) < self.vocab_size:
            return list(ids)
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt_token_ids contains ids out of vocabulary (size {self.vocab_size}): "
                f"{bad[:5]}"
            )
        return list(ids)

    def _check_token_constraints(self, params: SamplingParams) -> None:
        """logit_bias and allowed_token_ids ids within the vocabulary; bad_words tokenized
        (once per request, on this copy of the params) into ids within it."""
        params.verify_token_constraints()
        vocab = self.vocab_size
        if params.logit_bias:
            bad = sorted(t for t in params.logit_bias if t >= vocab)
            if bad:
                raise ValueError(
                    f"logit_bias has token ids out of vocabulary (size {vocab}): {bad[:5]}"
                )
        ids = params.allowed_token_ids
        if ids is not None:
            bad = sorted({t for t in ids if t >= vocab})
            if bad:
                raise ValueError(
                    f"allowed_token_ids has token ids out of vocabulary (size {vocab}): {bad[:5]}"
                )
            if len(ids) > vocab:
                raise ValueError(
                    f"allowed_token_ids holds {len(ids)} ids, more than the vocabulary ({vocab})."
                )
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError("bad_words needs a tokenizer; this engine has none.")
            params.update_from_tokenizer(self.tokenizer)
            assert params.bad_words_token_ids is not None
            bad = sorted({t for s in params.bad_words_token_ids for t in s if t >= vocab})
            if bad:
                raise ValueError(
                    f"bad_words tokenize to ids out of vocabulary (size {vocab}): {bad[:5]}"
                )
        else:
            params.bad_words_token_ids = None

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> tuple[Request, str | None]:
        """A ready Request (with its own copy of the params) and the prompt text;
        ``lora_request``: its LoRA adapter (the engine loads it when the request arrives)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params)}.")
        if lora_request is not None:
            if not isinstance(lora_request, LoRARequest):
                raise ValueError(
                    f"lora_request must be a LoRARequest, got {type(lora_request).__name__}."
                )
            if not self.lora_enabled:
                raise ValueError("lora_request needs an engine started with enable_lora.")
        if params.uses_kvc_fields and not self.kvc_enabled:
            field = next(
                f
                for f in ("max_cache_tokens", "compression_rate", "protected_window_size")
                + ("compress_once",)
                if getattr(params, f) is not None
            )
            raise ValueError(
                f"{field} needs an engine started with KV-Compress (enable_kvc / --enable-kvc)."
            )
        text, ids = self.tokenize(prompt)
        max_len = self.model_config.max_model_len
        if len(ids) > max_len:
            raise ValueError(
                f"prompt is {len(ids)} tokens long, longer than max_model_len ({max_len})."
            )
        params = copy.copy(params)
        if (params.best_of or params.n) > params.n and params.logprobs is None:
            params.logprobs = 0  # best_of ranks by cumulative logprob; hidden from the output
            params.hide_logprobs = True
        params.stop = list(params.stop or [])
        params.all_stop_token_ids = set(params.stop_token_ids or [])
        self._check_token_constraints(params)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}.")
        req = Request(
            request_id,
            ids,
            params,
            eos_token_id=self.eos_token_id,
            arrival_time=arrival_time,
            priority=priority,
            max_model_len=max_len,
        )
        if isinstance(prompt, dict) and prompt.get("cache_salt") is not None:
            salt = prompt["cache_salt"]
            if not isinstance(salt, str) or not salt:
                raise ValueError("cache_salt must be a non-empty string.")
            req.cache_salt = salt
        req.lora_request = lora_request
        return req, text
