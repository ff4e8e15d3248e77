"""What every decoder-only model shares: weight loading through per-parameter loaders."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.distributed.parallel_state import tp_info

# fp8 checkpoints' KV-cache scales (compressed-tensors / llm-compressor: per layer, or per
# KV head): "model.layers.3.self_attn.k_scale"; q_scale and prob_scale are not used here
_KV_SCALE = re.compile(r"layers\.(\d+)\.self_attn\.(?:attn\.)?([kv])_scale$")
_UNUSED_SCALES = (".q_scale", ".prob_scale")


class CausalLM(nn.Module):
    """Base of the model classes. Subclasses build ``self.model`` (embeddings, layers, norm)
    and ``self.lm_head``, and list in ``packed_modules`` how checkpoint names map onto fused
    layers: (fused name, checkpoint name, shard id)."""

    packed_modules: list[tuple[str, str, str | int]] = [
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    ]
    tie_word_embeddings: bool = False
    final_logit_softcapping: float | None = None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """[num_tokens] ids and positions -> [num_tokens, hidden_size] final hidden states."""
        return self.model(input_ids, positions, metadata)

    def greedy_tokens(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """[n, hidden] -> [n] argmax ids without the [n, vocab] logits (``LMHead.argmax``:
        under TP the vocabulary is never gathered); None for soft-capped logits, where
        tanh's rounding can make ties that the argmax of the raw logits would not see."""
        if self.final_logit_softcapping:
            return None
        return self.lm_head.argmax(hidden_states)

    def compute_logits(self, hidden_states: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] logits, float32 unless ``float32=False`` (then the model
        dtype, for an argmax-only step: the float32 copy of a 256 x 152k batch costs more
        device time than the argmax itself). Soft-capped logits are always float32."""
        float32 = float32 or bool(self.final_logit_softcapping)
        logits = self.lm_head(hidden_states, float32=float32)
        if self.final_logit_softcapping:
            cap = self.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

    def attention_layers(self) -> list[nn.Module]:
        from pagedllm.model.layers.attention import Attention

        return [m for m in self.modules() if isinstance(m, Attention)]

    def normalize_name(self, name: str) -> str | None:
        """Checkpoint name -> our parameter name; None to skip the tensor."""
        if "rotary_emb.inv_freq" in name:
            return None
        if name.startswith("language_model."):
            name = name[len("language_model.") :]
        if self.tie_word_embeddings and name == "lm_head.weight":
            return None
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load (checkpoint name, tensor) pairs; raises ValueError on an unknown name, a shape
        mismatch, or parameters that no tensor filled."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for ckpt_name, tensor in weights:
            kv_scale = _KV_SCALE.search(ckpt_name)
            if kv_scale is not None:
                self._load_kv_scale(int(kv_scale[1]), kv_scale[2], tensor)
                continue
            if ckpt_name.endswith(_UNUSED_SCALES):
                continue
            name = self.normalize_name(ckpt_name)
            if name is None:
                continue
            special = self.load_special(name, tensor, params)
            if special is not None:
                loaded.add(special)
                continue
            for fused, part, shard in self.packed_modules:
                if f".{part}." in name:
                    target = name.replace(f".{part}.", f".{fused}.")
                    if target not in params:
                        raise ValueError(f"checkpoint tensor {ckpt_name!r} has no parameter")
                    param = params[target]
                    param.weight_loader(param, tensor, shard)  # type: ignore[attr-defined]
                    loaded.add(target)
                    break
            else:
                if name not in params:
                    raise ValueError(f"checkpoint tensor {ckpt_name!r} has no parameter")
                param = params[name]
                loader = getattr(param, "weight_loader", None)
                if loader is not None:
                    loader(param, tensor)
                else:
                    if param.shape != tensor.shape:
                        raise ValueError(
                            f"{ckpt_name}: expected shape {tuple(param.shape)}, "
                            f"got {tuple(tensor.shape)}"
                        )
                    param.data.copy_(tensor)
                loaded.add(name)
        missing = [n for n in params if n not in loaded and not self._is_tied(n)]
        if missing:
            raise ValueError(f"checkpoint has no weights for {missing[:5]} ({len(missing)} in all)")

    def _load_kv_scale(self, layer: int, which: str, tensor: torch.Tensor) -> None:
        """A checkpoint's K or V cache scale of attention layer ``layer``: one value, or one
        per KV head (this rank's share under tensor parallelism); the fp8 cache starts from
        it (``kv_layout.KVCacheLayout.bind``); other caches do not use it."""
        attn = self.attention_layers()[layer]
        if attn.checkpoint_kv_scale is None:
            attn.checkpoint_kv_scale = torch.ones(2, attn.num_kv_heads)
        values = tensor.detach().float().flatten().cpu()
        kvh = attn.num_kv_heads
        rank, tp = tp_info()
        if values.numel() == kvh * tp:
            # Example: 8 KV heads over tp 2 -> rank 1 takes heads 4..7 (a KV head on several
            # ranks, tp > heads: rank r holds head r * heads // tp)
            values = values[rank * kvh : (rank + 1) * kvh]
        elif values.numel() > 1 and values.numel() < tp and tp % values.numel() == 0:
            values = values[rank * values.numel() // tp : rank * values.numel() // tp + 1]
        if values.numel() not in (1, kvh):
            raise ValueError(
                f"layers.{layer}.self_attn.{which}_scale has {values.numel()} values; expected "
                f"1 or one per KV head ({kvh * tp})"
            )
        if not bool((values > 0).all()) or not bool(torch.isfinite(values).all()):
            raise ValueError(f"layers.{layer}.self_attn.{which}_scale must be positive")
        attn.checkpoint_kv_scale[0 if which == "k" else 1] = values

    def load_special(
        self, name: str, tensor: torch.Tensor, params: dict[str, nn.Parameter]
    ) -> str | None:
        """A model's own mapping for a checkpoint tensor (e.g. one expert's weight into the
        stacked experts): the parameter it loaded, or None to go the usual way."""
        return None

    def _is_tied(self, name: str) -> bool:
        return self.tie_word_embeddings and name == "lm_head.weight"

    def init_dummy_weights(self, seed: int = 0) -> None:
        """Random weights (``--load-format dummy``) of a realistic scale, for speed tests.

        Drawn on the parameters' own device (one generator per device, seeded with ``seed``):
        drawing an 8B model's 8 billion floats on the host and copying them over would add
        a minute or more to every GPU engine's start-up."""
        gens: dict[torch.device, torch.Generator] = {}
        for name, p in self.named_parameters():
            if "norm" in name:
                if getattr(self, "norm_offset", 0.0):
                    p.data.zero_()
                else:
                    p.data.fill_(1.0)
                continue
            if p.device not in gens:
                gens[p.device] = torch.Generator(device=p.device).manual_seed(seed)
            p.data.uniform_(-0.02, 0.02, generator=gens[p.device])
