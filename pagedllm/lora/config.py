"""LoRA's engine settings (``--enable-lora`` and its flags) and the adapters to load at start.

``LoRAConfig`` is frozen and checked in ``__post_init__`` (a ValueError naming the field);
``lora_config_from`` builds it from ``EngineArgs`` and refuses the engine features LoRA does
not run with (each named in its ValueError) rather than ignoring the adapters there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

# the architectures whose decoder layers LoRA attaches to (layers.py: fused qkv_proj and
# o_proj, a dense gate_up_proj and down_proj); the mixtures of experts are not among them
LORA_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma3ForCausalLM",
)
MAX_LORA_RANK = 512  # vLLM's largest


@dataclass(frozen=True)
class LoRAModulePath:
    """An adapter to load at start-up (``--lora-modules``): its name, its PEFT folder and
    (informational) the base model it was trained on."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(value: Any) -> LoRAModulePath:
    """One ``--lora-modules`` entry, vLLM's two forms: ``name=path`` or JSON
    ``{"name": ..., "path": ..., "base_model_name": ...}`` (or that dict itself).
    Example: 'sql=/adapters/sql' -> LoRAModulePath('sql', '/adapters/sql')."""
    if isinstance(value, LoRAModulePath):
        return value
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"lora_modules entry {value!r} is not valid JSON: {e}") from None
    if isinstance(value, dict):
        unknown = set(value) - {"name", "path", "base_model_name"}
        if unknown:
            raise ValueError(f"lora_modules entry has unknown fields {sorted(unknown)}.")
        name, path = value.get("name"), value.get("path")
        base = value.get("base_model_name")
        if base is not None and not isinstance(base, str):
            raise ValueError("lora_modules entry: base_model_name must be a string.")
    elif isinstance(value, str) and "=" in value:
        name, path = value.split("=", 1)
        base = None
    else:
        raise ValueError(
            f"lora_modules entry {value!r} must be 'name=path' or JSON "
            '{"name": ..., "path": ..., "base_model_name": ...}.'
        )
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"lora_modules entry {value!r} has no name.")
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"lora_modules entry {value!r} has no path.")
    return LoRAModulePath(name.strip(), path.strip(), base)


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters (``--enable-lora``), vLLM's fields and defaults.

    ``max_loras``: distinct adapters in one step (the device's adapter slots; the scheduler
    holds back a request whose adapter would be one too many). ``max_lora_rank``: the largest
    rank an adapter may have (the slots are sized for it). ``max_cpu_loras``: adapters kept
    loaded in host memory (None: ``max_loras``); one more evicts the least recently used
    adapter no request is using. ``lora_modules``: adapters loaded at start-up, given ids
    1, 2, ... in order."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_modules: tuple[LoRAModulePath, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}.")
        if self.max_lora_rank > MAX_LORA_RANK:
            raise ValueError(
                f"max_lora_rank must be at most {MAX_LORA_RANK}, got {self.max_lora_rank}."
            )
        cpu = self.max_cpu_loras
        if cpu is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        elif isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < self.max_loras:
            raise ValueError(
                f"max_cpu_loras must be an integer >= max_loras ({self.max_loras}), got {cpu!r}."
            )
        mods = tuple(parse_lora_module(m) for m in self.lora_modules)
        object.__setattr__(self, "lora_modules", mods)
        names = [m.name for m in mods]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"lora_modules names must be unique; repeated: {dup}.")
        if len(mods) > int(self.max_cpu_loras or 0):
            raise ValueError(
                f"lora_modules names {len(mods)} adapters, more than max_cpu_loras "
                f"({self.max_cpu_loras}) can hold; raise max_cpu_loras."
            )

    @property
    def slot_rank(self) -> int:
        """The rank of the device's adapter slots: ``max_lora_rank`` rounded up to a power of
        two, at least 16 (the Triton kernels' smallest matmul tile). Example: 8 -> 16, 24 ->
        32."""
        r = 16
        while r < self.max_lora_rank:
            r *= 2
        return r


def lora_config_from(args: Any, hf_config: Any) -> LoRAConfig | None:
    """The LoRA config ``EngineArgs`` ask for (None without ``enable_lora``), or a ValueError
    naming the argument LoRA cannot run with: a mixture-of-experts or other architecture
    without dense projections, and the features whose paths do not carry adapters yet."""
    mods = args.lora_modules
    if isinstance(mods, (str, dict, LoRAModulePath)):
        mods = [mods]
    if not args.enable_lora:
        if mods:
            raise ValueError("lora_modules needs enable_lora (--enable-lora).")
        return None
    config = LoRAConfig(
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        lora_modules=tuple(mods or ()),
    )
    # lazy factory: the model registry imports torch; importing the config must stay cheap
    # (EngineArgs.create_engine_config, the only caller, is one too)
    from pagedllm.model.registry import resolve_architecture

    architecture = resolve_architecture(hf_config)
    if architecture not in LORA_ARCHITECTURES:
        raise ValueError(
            f"enable_lora supports the architectures {list(LORA_ARCHITECTURES)}; this model "
            f"is {architecture}."
        )
    refused = {
        "enable_kvc": args.enable_kvc,  # its own runner and graphs do not set adapter slots
        "speculative_config": args.speculative_config,
        "data_parallel_size > 1": args.data_parallel_size > 1,
        "decode_context_parallel_size > 1": args.decode_context_parallel_size > 1,
        # the consumer's prefix would be the producer's, computed with whatever adapter
        "kv_transfer_config": args.kv_transfer_config,
    }
    for name, value in refused.items():
        if value:
            raise ValueError(f"enable_lora cannot be combined with {name} (yet).")
    return config
