"""Architecture name -> model class."""

from __future__ import annotations

from typing import Any

_ARCHS = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("llama", "Qwen3ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("moe", "Qwen3MoeForCausalLM"),
    "Qwen2MoeForCausalLM": ("moe", "Qwen2MoeForCausalLM"),
    "MixtralForCausalLM": ("moe", "MixtralForCausalLM"),
}
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}


def resolve_architecture(hf_config: Any) -> str:
    """The supported architecture of a config, or ValueError naming what was found."""
    for arch in getattr(hf_config, "architectures", None) or []:
        if arch in _ARCHS:
            return arch
    arch = _MODEL_TYPES.get(getattr(hf_config, "model_type", ""))
    if arch is None:
        found = getattr(hf_config, "architectures", None) or getattr(hf_config, "model_type", "?")
        raise ValueError(f"unsupported model architecture {found}; supported: {sorted(_ARCHS)}")
    return arch


def get_model_class(hf_config: Any) -> type:
    import importlib

    module, cls = _ARCHS[resolve_architecture(hf_config)]
    return getattr(importlib.import_module(f"pagedllm.model.models.{module}"), cls)
