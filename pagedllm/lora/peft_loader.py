"""Reads a PEFT LoRA checkpoint and checks it against the base model and ``LoRAConfig``.

A PEFT adapter is a folder with ``adapter_config.json`` (``r``, ``lora_alpha``,
``use_rslora``, ``target_modules``, ...) and ``adapter_model.safetensors`` whose tensors are
named like ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` ([r, in]) and
``...q_proj.lora_B.weight`` ([out, r]). A module's output gains ``scale * x A^T B^T`` with
``scale = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``; PEFT's
``rank_pattern`` / ``alpha_pattern`` override r and alpha per module). The scale is folded
into B here, once, so the device never multiplies by it.

Supported targets: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj of the
decoder layers. Everything else is refused with a ValueError naming the adapter and the
problem: a rank above ``max_lora_rank``, other targets (embed_tokens, lm_head,
modules_to_save), DoRA, LoRA biases, shapes that do not match the base model, missing files.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedllm.lora.request import LoRARequest

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# e.g. "base_model.model.model.layers.3.mlp.down_proj.lora_B.weight" -> (3, down_proj, B)
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass
class LoRAWeights:
    """One adapter's tensors on the host, whole (not sharded): (layer, module) -> (A [r, in],
    B [out, r] already multiplied by the scale), in the model's dtype."""

    lora_int_id: int
    lora_name: str
    rank: int
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict
    )

    def nbytes(self) -> int:
        """Host bytes of the tensors."""
        return sum(a.nbytes + b.nbytes for a, b in self.modules.values())


def projection_shapes(text_config: Any) -> dict[str, tuple[int, int]]:
    """Each target module's weight shape (out, in) in the base model (whole, before tensor
    parallelism). Example (Llama, hidden 64, 4 heads of 16, 2 KV heads, MLP 128): q_proj
    (64, 64), k_proj (32, 64), o_proj (64, 64), gate_proj (128, 64), down_proj (64, 128)."""
    c = text_config
    hidden = int(c.hidden_size)
    heads = int(c.num_attention_heads)
    kv = int(getattr(c, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(c, "head_dim", None) or hidden // heads)
    inter = int(c.intermediate_size)
    q, k = heads * head_dim, kv * head_dim
    return {
        "q_proj": (q, hidden),
        "k_proj": (k, hidden),
        "v_proj": (k, hidden),
        "o_proj": (hidden, q),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }


def _pattern_value(pattern: dict[str, Any], module_path: str, default: Any) -> Any:
    """PEFT's per-module override: the first key matching the end of the module's path.
    Example: {"q_proj": 8}, "model.layers.0.self_attn.q_proj" -> 8."""
    for key, value in (pattern or {}).items():
        if re.match(rf"(.*\.)?{key}$", module_path):
            return value
    return default


def read_adapter_config(request: LoRARequest) -> dict[str, Any]:
    """The adapter's ``adapter_config.json``, checked for what this engine cannot run."""
    name = request.lora_name
    path = os.path.join(request.lora_path, CONFIG_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"LoRA adapter {name!r}: {path} not found (not a PEFT adapter folder).")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"LoRA adapter {name!r}: cannot read {path}: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"LoRA adapter {name!r}: {path} is not a JSON object.")
    peft_type = cfg.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"LoRA adapter {name!r}: peft_type {peft_type!r} is not LORA.")
    if cfg.get("use_dora"):
        raise ValueError(f"LoRA adapter {name!r}: DoRA (use_dora) is not supported.")
    if cfg.get("modules_to_save"):
        raise ValueError(
            f"LoRA adapter {name!r}: modules_to_save {cfg['modules_to_save']} is not supported "
            f"(only the target modules {list(TARGET_MODULES)})."
        )
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {name!r}: LoRA biases (bias={cfg['bias']!r}) are not "
                         "supported.")  # fmt: skip
    if cfg.get("fan_in_fan_out"):
        raise ValueError(f"LoRA adapter {name!r}: fan_in_fan_out is not supported.")
    for key in ("r", "lora_alpha"):
        v = cfg.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise ValueError(f"LoRA adapter {name!r}: {CONFIG_FILE} needs a positive {key}.")
    return cfg


def load_peft_adapter(
    request: LoRARequest,
    text_config: Any,
    max_lora_rank: int,
    dtype: torch.dtype,
) -> LoRAWeights:
    """The adapter of ``request`` read from its PEFT folder and checked (see the module
    docstring); a ValueError naming the adapter and the problem otherwise."""
    from safetensors import safe_open

    name = request.lora_name
    cfg = read_adapter_config(request)
    wpath = os.path.join(request.lora_path, WEIGHTS_FILE)
    if not os.path.isfile(wpath):
        raise ValueError(f"LoRA adapter {name!r}: {wpath} not found.")
    shapes = projection_shapes(text_config)
    num_layers = int(text_config.num_hidden_layers)
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(wpath, framework="pt") as f:
            for key in f.keys():
                m = _KEY.search(key)
                if m is None:
                    what = "DoRA magnitudes" if "lora_magnitude" in key else f"tensor {key!r}"
                    raise ValueError(
                        f"LoRA adapter {name!r}: {what} is not supported (only the target "
                        f"modules {list(TARGET_MODULES)} of the decoder layers)."
                    )
                layer, module, ab = int(m[1]), m[2], m[3]
                if module not in TARGET_MODULES:
                    raise ValueError(
                        f"LoRA adapter {name!r}: target module {module!r} is not supported "
                        f"(only {list(TARGET_MODULES)})."
                    )
                if layer >= num_layers:
                    raise ValueError(
                        f"LoRA adapter {name!r}: {key} is for layer {layer}; the base model "
                        f"has {num_layers} layers."
                    )
                found.setdefault((layer, module), {})[ab] = f.get_tensor(key)
    except ValueError:
        raise
    except Exception as e:  # a truncated or foreign file
        raise ValueError(f"LoRA adapter {name!r}: cannot read {wpath}: {e}") from None
    if not found:
        raise ValueError(f"LoRA adapter {name!r}: {wpath} holds no LoRA weights.")
    weights = LoRAWeights(request.lora_int_id, name, 0)
    for (layer, module), ab in sorted(found.items()):
        where = f"layers.{layer}.{module}"
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: {where} has lora_{''.join(ab)} only.")
        a, b = ab["A"], ab["B"]
        out_f, in_f = shapes[module]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_f or b.shape != (out_f, r):
            raise ValueError(
                f"LoRA adapter {name!r}: {where} has lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)}; the base model needs [r, {in_f}] and [{out_f}, r]."
            )
        path = f"model.layers.{layer}.{'mlp' if module in _MLP else 'self_attn'}.{module}"
        declared = _pattern_value(cfg.get("rank_pattern") or {}, path, cfg["r"])
        if r != declared:
            raise ValueError(
                f"LoRA adapter {name!r}: {where} has rank {r}, its config says {declared}."
            )
        if r > max_lora_rank:
            raise ValueError(
                f"LoRA adapter {name!r}: rank {r} ({where}) is above max_lora_rank "
                f"({max_lora_rank}); raise --max-lora-rank."
            )
        alpha = _pattern_value(cfg.get("alpha_pattern") or {}, path, cfg["lora_alpha"])
        scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        weights.modules[(layer, module)] = (
            a.to(dtype).contiguous(),
            (b.float() * scale).to(dtype).contiguous(),
        )
        weights.rank = max(weights.rank, r)
    return weights


_MLP = ("gate_proj", "up_proj", "down_proj")
