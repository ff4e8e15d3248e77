"""The kvpress peer (NVIDIA kvpress 0.5.5) on the KV-Compress quality tasks, on token ids.

Runs with kvpress's own transformers (kvpress pins transformers<5.3): inside the venv that
``benchmarks/peers/kvpress_setup.sh`` makes (/tmp/kvpress_venv), or with any python whose torch
fits once ``benchmarks/peers/kvpress_gpu_setup.sh`` has layered kvpress and transformers 5.2 into
a folder of their own (``--site`` puts it first on ``sys.path``; a GPU machine without a network).
It imports only kvpress, transformers, torch and the stdlib::

    /tmp/kvpress_venv/bin/python benchmarks/peers/kvpress_run.py --model HF_DIR \\
        --tasks tasks.json --press adakv_snapkv,snapkv,kvzip,none --ratios 2,4,8,16,32,64 \\
        --window 32 --out 'result_{press}.json'
    python3 benchmarks/peers/kvpress_run.py --site /tmp/kvp_site --device cuda \\
        --dtype bfloat16 ...            # after bash benchmarks/peers/kvpress_gpu_setup.sh

For every task and rate ``cr`` a press gets ``compression_ratio = 1 - 1/cr``; every knob of its
own keeps kvpress's default except the observation window of the SnapKV family (``--window``).
Presses (``--press``, comma-separated; names as in kvpress's own evaluation registry where it has
one):

* SnapKV family (window ``--window``, kernel 5): ``snapkv`` (last-window attention, pooled; the
  window's own keys kept; top ``int(k_len * (1 - ratio))`` keys per KV head: the cache is
  physically shortened), ``adakv_snapkv`` (AdaKV, alpha_safeguard 0.2: the same scores ranked
  across the KV heads of a layer, heads keep different counts), ``critical_adakv_snapkv``
  (CriticalKV's two-stage ``|W_o v|`` rescoring inside AdaKV), ``pyramidkv`` (SnapKV scores,
  budget shrinking from the first layer to the last, the total kept), ``chunkkv`` (SnapKV scores,
  whole chunks of 20 tokens kept).
* Expected Attention (scores keys by the attention that future queries, modelled from the prompt's
  query statistics and the averaged RoPE of the next 512 positions, would pay them; 4 sink tokens
  kept): ``expected_attention`` (plain, uniform per head), ``adakv_expected_attention``
  (``AdaKVPress(ExpectedAttentionPress(epsilon=1e-2))``: kvpress's leaderboard
  "expected_attention"), ``critical_adakv_expected_attention`` (``use_vnorm=False`` inside
  CriticalAdaKV, as kvpress's registry has it).
* Query-free: ``keydiff`` (keys least similar to the mean key direction), ``block_keydiff``
  (KeyDiff applied block by block, 128 tokens, as in its paper), ``streaming_llm`` (4 sinks +
  the most recent tokens), ``tova`` (attention of the last token, averaged over heads),
  ``adakv_compactor`` (Compactor: key leverage blended with non-causal chunked attention, inside
  AdaKV, as on kvpress's leaderboard), ``cur`` (CurDKV key x value leverage), ``lagkv`` (keys and
  values scored against the next 128-token partition), ``cap`` (CapKV log-det capacity).
* Context replay (run the literal way: they re-run the context after the prefill): ``kvzip``
  (each KV scored by its maximum attention while the model reconstructs the context, "Repeat the
  previous context exactly."; budget spread over layers and heads, evicted keys masked),
  ``kvzip_plus`` (KVzip+ normalization: ``1/||h||`` and ``||W_o v||``), ``kvgrad`` (KVzip's
  replay scored by input x gradient, one backward per 512-token chunk), ``kvcompose``
  (KVCompose, structured: the context replayed under eager attention, each head's tokens ranked
  by the maximum attention they get, aligned into composite tokens; a budget per layer). The
  tasks' prompts are plain text, so KVzip's and KVgrad's replay uses KVzip's own framing for a
  tokenizer without a chat template (no prefix, ``"\\n"`` before the repeated chunk) even when
  the tokenizer has one (kvpress would otherwise skip the template prefix's length of the context
  and append the chat suffix). None of the four runs on Gemma 3 (see ``NO_GEMMA3``; the file
  says why and holds no results).
* ``none``: the full cache (one record per task, ``rate`` 1).

Presses of 0.5.5 that do not run here: FastKVzipPress (gate weights downloaded from the hub per
model), KVzapPress (a surrogate model downloaded from the hub), QFilterPress (per-model filters
from the hub), DuoAttentionPress (head patterns downloaded, or scored on the fly on a downloaded
dataset), RestoreKVPress (learned restore embeddings downloaded), LUKVPress (budget curves
downloaded), ExpectedAttentionStatsPress (query statistics from the hub): nothing is downloaded at
benchmark time. DecodingPress, CAMPress, CompressionRatioDecodingPress, PrefillDecodingPress and
DMSPress (threshold, no rate) compress during decoding, which never reaches its interval in the few
greedy tokens here; FinchPress needs the pipeline's question delimiter; ThinKPress prunes key
channels, not KVs; SimLayerKVPress has no rate (a lazy-layer threshold); ObservedAttentionPress
(H2O-like) needs the prefill's attention weights, which only an eager prefill returns (AdaKV's
masking refuses eager); RandomPress and KnormPress are the weak baselines of kvpress's leaderboard;
ChunkPress, BlockPress, ComposedPress, KeyRerotationPress, PerLayerCompressionPress, MergingPress,
EntropyGatedChunkKVPress, LeverageScorePress and NonCausalAttnPress are wrappers or parts of the
presses above.

Fairness (same as our engine's side): the WHOLE prompt (``prompt_ids``: context + question) is
prefilled and compressed, so an observation window is the last ``window`` prompt tokens, the
question's included; greedy decoding (``new_tokens`` of the task, else ``--new-tokens``, default
12; EOS ignored) then runs on the compressed cache. kvpress compresses a layer's cache in a forward
hook after that layer's attention (a context-replay press after the whole prefill), so the
prefill's own outputs (and the first generated token) see the full prompt. Continuation tasks: the
context (``prompt_ids[:context_len]``) is prefilled and compressed, then the continuation is
teacher-forced; the mean NLL per continuation token is reported (its first token is predicted by
the context's last logits, as our engine's ``prompt_logprobs`` do).

Since a forward-hook press acts after each layer's attention, the prefill (hidden states, logits)
does not depend on the press: by default the prompt is prefilled ONCE per task with the full cache
and each press and rate compresses a copy of that cache by calling the press's own ``compress``
with the captured attention inputs, exactly what kvpress's ``forward_hook`` does (``--literal``
instead runs ``with press(model): model(prompt)`` for every press and rate; both give the same
tokens and counts). The context-replay presses always run the literal way.

Gemma 3 (``Gemma3ForCausalLM``): only the global (full attention) layers are compressed, the
sliding-window layers are untouched (kvpress does the same for ``Gemma3ForConditionalGeneration``
only), and the KV counts cover the global layers only. KV counts are summed over the compressed
layers and their KV heads: ``kept_kvs`` (unmasked KVs for the masking presses: AdaKV,
CriticalAdaKV, KVzip and KVgrad keep every KV in memory and hide the evicted ones from attention
behind a fake key whose scaled dot product with the current queries is very negative), ``full_kvs``
and ``stored_kvs`` (what the cache physically holds). Gemma-3-270M has ONE KV head per layer, so
AdaKV (which only reallocates across the heads of a layer) selects exactly what SnapKV selects
there.

Tasks (a JSON list, or ``{"tasks": [...]}``; from ``benchmarks/kvc_ruler.py`` or
``benchmarks/kvcompress_tasks.py``): ``kind``, ``length``, ``prompt_ids``, optional ``id`` (else
the index), ``new_tokens``, ``answers`` (scored by the caller from ``output``) or ``answer``
(then ``correct``: the answer is in the output), and ``context_len`` for ``continuation``.

One output JSON per press: ``press``, ``knobs`` (the press as kvpress prints it, at the first
rate), ``mode`` (``literal`` or ``shared_prefill``), ``skipped`` (why, when the press cannot run
on this model; ``results`` is then empty), versions and device, and ``results``: one record per
task and rate with ``id``, ``kind``, ``length``, ``rate``, ``compression_ratio``, ``output``
(greedy text, special tokens skipped) / ``output_ids`` / ``correct`` (only with ``answer``), or
``nll`` (continuation), ``kept_kvs``, ``full_kvs``, ``stored_kvs``, ``seconds`` (compression +
decoding at this rate, the prefill too in literal mode) and ``prefill_seconds`` (the shared one).
"""

from __future__ import annotations

import sys


def _site_first(argv: list[str]) -> None:
    """Put ``--site DIR`` first on ``sys.path`` before kvpress and transformers are imported."""
    for i, arg in enumerate(argv):
        if arg == "--site" and i + 1 < len(argv):
            sys.path.insert(0, argv[i + 1])
        elif arg.startswith("--site="):
            sys.path.insert(0, arg.split("=", 1)[1])


_site_first(sys.argv)
# Hub kernels are code downloaded at run time (never wanted here), and a `kernels` package newer
# than kvpress's transformers breaks that transformers' import: hide it.
sys.modules["kernels"] = None  # type: ignore[assignment]

import argparse  # noqa: E402
import copy  # noqa: E402
import importlib.metadata as md  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from contextlib import contextmanager, nullcontext  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import kvpress  # noqa: E402,F401  (importing kvpress patches attention for the masking presses)
import torch  # noqa: E402
from kvpress import (  # noqa: E402
    AdaKVPress,
    BasePress,
    BlockPress,
    CapPress,
    ChunkKVPress,
    CompactorPress,
    CriticalAdaKVPress,
    CURPress,
    ExpectedAttentionPress,
    KeyDiffPress,
    KVComposePress,
    KVgradPress,
    KVzipPress,
    LagKVPress,
    PyramidKVPress,
    SnapKVPress,
    StreamingLLMPress,
    TOVAPress,
)
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache  # noqa: E402
from transformers.masking_utils import create_sliding_window_causal_mask  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

NEW_TOKENS = 12


class _PlainReplay:
    """KVzip's replay framed for a plain-text prompt: no chat-template prefix before the context
    and ``"\\n"`` before the repeated chunk (KVzip's own choice for a tokenizer without a chat
    template), whatever template the tokenizer carries."""

    def prepare(self, model: Any, tokenizer: Any, prev_postfix_size: int = 8) -> Any:
        self.prefix_length = self.start_idx = 0  # KVgrad sets start_idx before prepare
        self._suffix_ids = tokenizer.encode("\n", return_tensors="pt", add_special_tokens=False)
        return super().prepare(model, tokenizer, prev_postfix_size)  # type: ignore[misc]


class PlainKVzipPress(_PlainReplay, KVzipPress):
    """:class:`KVzipPress` with :class:`_PlainReplay`'s framing."""


class PlainKVgradPress(_PlainReplay, KVgradPress):
    """:class:`KVgradPress` with :class:`_PlainReplay`'s framing."""


#: name -> (builder of the press from ``(compression_ratio, window)``, needs the literal path)
PressBuilder = Callable[[float, int], BasePress]
PRESS_BUILDERS: dict[str, tuple[PressBuilder, bool]] = {
    "snapkv": (lambda r, w: SnapKVPress(compression_ratio=r, window_size=w), False),
    "adakv_snapkv": (
        lambda r, w: AdaKVPress(SnapKVPress(compression_ratio=r, window_size=w)),
        False,
    ),
    "critical_adakv_snapkv": (
        lambda r, w: CriticalAdaKVPress(SnapKVPress(compression_ratio=r, window_size=w)),
        False,
    ),
    "pyramidkv": (lambda r, w: PyramidKVPress(compression_ratio=r, window_size=w), False),
    "chunkkv": (lambda r, w: ChunkKVPress(SnapKVPress(compression_ratio=r, window_size=w)), False),
    "expected_attention": (lambda r, w: ExpectedAttentionPress(compression_ratio=r), False),
    "adakv_expected_attention": (
        lambda r, w: AdaKVPress(ExpectedAttentionPress(compression_ratio=r, epsilon=1e-2)),
        False,
    ),
    "critical_adakv_expected_attention": (
        lambda r, w: CriticalAdaKVPress(
            ExpectedAttentionPress(compression_ratio=r, use_vnorm=False)
        ),
        False,
    ),
    "keydiff": (lambda r, w: KeyDiffPress(compression_ratio=r), False),
    "block_keydiff": (
        lambda r, w: BlockPress(KeyDiffPress(compression_ratio=r), block_size=128),
        False,
    ),
    "streaming_llm": (lambda r, w: StreamingLLMPress(compression_ratio=r), False),
    "tova": (lambda r, w: TOVAPress(compression_ratio=r), False),
    "adakv_compactor": (lambda r, w: AdaKVPress(CompactorPress(compression_ratio=r)), False),
    "cur": (lambda r, w: CURPress(compression_ratio=r), False),
    "lagkv": (lambda r, w: LagKVPress(compression_ratio=r), False),
    "cap": (lambda r, w: CapPress(compression_ratio=r), False),
    "kvzip": (lambda r, w: PlainKVzipPress(compression_ratio=r), True),
    "kvzip_plus": (
        lambda r, w: PlainKVzipPress(compression_ratio=r, kvzip_plus_normalization=True),
        True,
    ),
    "kvgrad": (lambda r, w: PlainKVgradPress(compression_ratio=r), True),
    "kvcompose": (lambda r, w: KVComposePress(compression_ratio=r), True),
}
PRESSES = (*PRESS_BUILDERS, "none")
#: context-replay presses that do not fit Gemma 3: KVzip and KVgrad raise for it, KVCompose
#: hooks and compresses every layer, the sliding-window ones included
NO_GEMMA3 = {
    "kvzip": "KVzipPress raises for Gemma 3",
    "kvzip_plus": "KVzipPress raises for Gemma 3",
    "kvgrad": "KVgradPress (a KVzipPress) raises for Gemma 3",
    "kvcompose": "KVComposePress would compress the sliding-window layers too",
}


def make_press(name: str, rate: float, window: int) -> BasePress | None:
    """The kvpress press for ``name`` at compression rate ``rate`` (``None`` for ``none``)."""
    if name == "none":
        return None
    if name not in PRESS_BUILDERS:
        raise ValueError(f"unknown press {name!r}; choose from {PRESSES}")
    return PRESS_BUILDERS[name][0](1.0 - 1.0 / rate, window)


def is_literal(name: str) -> bool:
    """True for a press that must run ``with press(model)`` (it re-runs the context)."""
    return name in PRESS_BUILDERS and PRESS_BUILDERS[name][1]


def unsupported(name: str, model: Any) -> str | None:
    """Why ``name`` cannot run on ``model`` (``None`` when it can)."""
    if name in NO_GEMMA3 and "Gemma3" in type(model).__name__:
        return NO_GEMMA3[name]
    return None


def decoder_layers(model: Any) -> list[Any]:
    """The decoder layers of a causal LM (or of the language model of a multimodal one)."""
    inner = model.model.language_model if hasattr(model.model, "language_model") else model.model
    return list(inner.layers)


def compressed_layers(model: Any) -> list[int]:
    """Indices of the layers a press compresses: all of them, or only the global (full
    attention) ones in a model with sliding-window layers (Gemma 3)."""
    return [
        i
        for i, layer in enumerate(decoder_layers(model))
        if not getattr(layer.self_attn, "is_sliding", False)
    ]


def is_hybrid(model: Any) -> bool:
    """True when the model mixes sliding-window and global layers (Gemma 3)."""
    return len(compressed_layers(model)) < len(decoder_layers(model))


class LayerRotary(torch.nn.Module):
    """A hybrid model's rotary embedding bound to one layer type: kvpress calls
    ``module.rotary_emb(x, position_ids)`` (Expected Attention, CapKV), while Gemma 3's rotary
    embedding in transformers 5.2 also needs the layer type (``full_attention`` for the global
    layers that are compressed here)."""

    def __init__(self, rotary: torch.nn.Module, layer_type: str) -> None:
        super().__init__()
        self.rotary = rotary
        self.layer_type = layer_type

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> Any:
        return self.rotary(x, position_ids, self.layer_type)


def attach_rotary(model: Any) -> None:
    """Give every compressed layer's attention its ``rotary_emb``, as ``BasePress.__call__``
    does (bound to the layer type in a hybrid model, see :class:`LayerRotary`)."""
    inner = model.model.language_model if hasattr(model.model, "language_model") else model.model
    layers = decoder_layers(model)
    for i in compressed_layers(model):
        kind = getattr(layers[i], "attention_type", None)
        rotary = inner.rotary_emb
        layers[i].self_attn.rotary_emb = rotary if kind is None else LayerRotary(rotary, kind)


@contextmanager
def press_hooks(press: BasePress, model: Any) -> Iterator[None]:
    """``press(model)`` restricted to :func:`compressed_layers`.

    For a model without sliding layers this IS ``press(model)``; otherwise it mirrors
    ``BasePress.__call__`` (post_init, rotary_emb, forward hook with kwargs) on the global layers.
    """
    if not is_hybrid(model):
        with press(model):
            yield
        return
    press.post_init_from_model(model)
    attach_rotary(model)
    layers = decoder_layers(model)
    hooks = []
    try:
        for i in compressed_layers(model):
            attn = layers[i].self_attn
            hooks.append(attn.register_forward_hook(press.forward_hook, with_kwargs=True))
        yield
    finally:
        for h in hooks:
            h.remove()


@contextmanager
def capture_attention_inputs(model: Any, store: dict[int, dict]) -> Iterator[None]:
    """Record, for every compressed layer, the keyword arguments its attention module was called
    with (``hidden_states``, ``position_embeddings``, ``cache_position``, ...): what kvpress's
    ``forward_hook`` hands to ``press.compress``."""
    layers = decoder_layers(model)
    hooks = []

    def make_hook(idx: int) -> Any:
        def hook(module: Any, args: Any, kwargs: dict, output: Any) -> None:
            store[idx] = dict(kwargs)

        return hook

    try:
        for i in compressed_layers(model):
            hooks.append(layers[i].self_attn.register_forward_hook(make_hook(i), with_kwargs=True))
        yield
    finally:
        for h in hooks:
            h.remove()


def compress_cache(press: BasePress, model: Any, cache: Any, inputs: dict[int, dict]) -> None:
    """Apply ``press`` to a prefilled cache, layer by layer, as kvpress's ``forward_hook`` does
    at the end of each compressed layer's prefill (attention weights: ``None``, as under sdpa)."""
    press.post_init_from_model(model)
    attach_rotary(model)
    layers = decoder_layers(model)
    for i in compressed_layers(model):
        module = layers[i].self_attn
        kwargs = inputs[i]
        layer = cache.layers[i]
        keys, values = press.compress(
            module, kwargs["hidden_states"], layer.keys, layer.values, None, kwargs
        )
        layer.keys, layer.values = keys, values


def reset_masks(model: Any) -> None:
    """Forget AdaKV's masked key indices (kvpress resets them at the next prefill anyway)."""
    for layer in decoder_layers(model):
        layer.self_attn.masked_key_indices = None


def kv_counts(model: Any, cache: Any) -> tuple[int, int]:
    """(kept, stored) KVs summed over the compressed layers and their KV heads; AdaKV's masked
    keys are stored but not kept."""
    layers = decoder_layers(model)
    kept = stored = 0
    for i in compressed_layers(model):
        keys = cache.layers[i].keys
        n = keys.shape[1] * keys.shape[2]
        stored += n
        masked = getattr(layers[i].self_attn, "masked_key_indices", None)
        kept += n - (0 if masked is None else int(masked[0].numel()))
    return kept, stored


def forward(model: Any, cache: Any, ids: list[int], pos0: int) -> torch.Tensor:
    """Run ``ids`` (at positions ``pos0``...) on the cache; return their logits ``(len, vocab)``.

    Positions are passed explicitly (the cache may be shorter than the sequence). In a hybrid
    model the compressed global layers hold fewer KVs than the sliding ones, so for more than one
    query the masks are built here: global layers see every cached KV plus the new ones causally;
    sliding layers get transformers' own mask at the true positions.
    """
    q = len(ids)
    dev = model.device
    input_ids = torch.tensor([ids], dtype=torch.long, device=dev)
    position_ids = torch.arange(pos0, pos0 + q, dtype=torch.long, device=dev).unsqueeze(0)
    kwargs: dict[str, Any] = {}
    if is_hybrid(model):
        cache_position = torch.arange(pos0, pos0 + q, dtype=torch.long, device=dev)
        kwargs["cache_position"] = cache_position
        if q > 1:
            g = compressed_layers(model)[0]
            k = cache.layers[g].get_seq_length()
            full = torch.ones(q, k + q, dtype=torch.bool, device=dev)
            full[:, k:] = torch.tril(torch.ones(q, q, dtype=torch.bool, device=dev))
            embeds = torch.zeros(1, q, model.config.hidden_size, dtype=model.dtype, device=dev)
            sliding = create_sliding_window_causal_mask(
                config=model.config,
                inputs_embeds=embeds,
                attention_mask=None,
                cache_position=cache_position,
                past_key_values=cache,
                position_ids=position_ids,
            )
            kwargs["attention_mask"] = {
                "full_attention": full[None, None],
                "sliding_attention": sliding,
            }
    out = model(input_ids=input_ids, past_key_values=cache, position_ids=position_ids, **kwargs)
    return out.logits[0]


def prefill(
    model: Any, ids: list[int], press: BasePress | None, capture: dict[int, dict] | None
) -> tuple[Any, torch.Tensor]:
    """Prefill ``ids`` into a fresh cache, under ``press`` if given, recording the attention
    inputs into ``capture`` if given; return the cache and the last position's logits."""
    cache = DynamicCache(config=model.config)
    reset_masks(model)
    ctx = press_hooks(press, model) if press is not None else nullcontext()
    cap = capture_attention_inputs(model, capture) if capture is not None else nullcontext()
    with ctx, cap:
        input_ids = torch.tensor([ids], dtype=torch.long, device=model.device)
        out = model(input_ids=input_ids, past_key_values=cache, logits_to_keep=1)
    return cache, out.logits[0, -1]


def greedy(model: Any, cache: Any, first_logits: torch.Tensor, pos0: int, n: int) -> list[int]:
    """``n`` greedy tokens from the prefill's last logits, continuing at position ``pos0``."""
    tok = int(first_logits.argmax())
    out = [tok]
    for i in range(n - 1):
        tok = int(forward(model, cache, [tok], pos0 + i)[-1].argmax())
        out.append(tok)
    return out


def continuation_nll(
    model: Any, cache: Any, first_logits: torch.Tensor, cont: list[int], pos0: int
) -> tuple[float, str]:
    """Mean NLL per token of ``cont`` teacher-forced on the cache (its first token from the
    prefill's last logits). One forward for the rest, or token by token when the compressed
    layers hold different numbers of KVs (PyramidKV: one causal mask cannot fit them all), or
    on a fresh copy of the cache when AdaKV's fake-key search fails for that many queries
    (ValueError)."""
    nll = [-float(torch.log_softmax(first_logits.float(), -1)[cont[0]])]
    lengths = {cache.layers[i].get_seq_length() for i in compressed_layers(model)}
    mode = "one_forward" if len(lengths) == 1 else "per_token"
    if mode == "one_forward":
        backup = copy.deepcopy(cache)
        try:
            logits = forward(model, cache, cont[:-1], pos0)
        except ValueError:
            cache, mode = backup, "per_token"
    if mode == "per_token":
        rows = [forward(model, cache, [t], pos0 + i)[-1] for i, t in enumerate(cont[:-1])]
        logits = torch.stack(rows)
    lp = torch.log_softmax(logits.float(), -1)
    nll += [-float(lp[i, t]) for i, t in enumerate(cont[1:])]
    return sum(nll) / len(nll), mode


def _sync(model: Any) -> None:
    """Wait for the device's queued work (so that a timer reads finished work)."""
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)


def run_task(
    model: Any,
    tok: Any,
    task: dict,
    presses: list[str],
    rates: list[int],
    window: int,
    new_tokens: int,
    literal: bool,
    seed: int = 0,
) -> dict[str, list[dict]]:
    """All presses and rates of one task: per press, one record per rate (one, ``rate`` 1, for
    ``none``). Without ``literal`` the forward-hook presses share one full-cache prefill; the
    context-replay presses always prefill under the press. Torch's generator is seeded with
    ``seed`` before every press and rate, so both paths draw the same random numbers."""
    cont = task["kind"] == "continuation"
    ids = task["prompt_ids"][: task["context_len"]] if cont else task["prompt_ids"]
    rest = task["prompt_ids"][task["context_len"] :] if cont else []
    n_new = int(task.get("new_tokens") or new_tokens)
    captured: dict[int, dict] = {}
    base = base_logits = None
    prefill_s = 0.0
    shared = [p for p in presses if p == "none" or not (literal or is_literal(p))]
    if shared:
        t0 = time.perf_counter()
        need_inputs = any(p != "none" for p in shared)
        base, base_logits = prefill(model, ids, None, captured if need_inputs else None)
        _sync(model)
        prefill_s = time.perf_counter() - t0
    full = len(compressed_layers(model)) * model.config.num_key_value_heads * len(ids)
    out: dict[str, list[dict]] = {}
    for press_name in presses:
        records = []
        for rate in [1] if press_name == "none" else rates:
            t0 = time.perf_counter()
            press = make_press(press_name, rate, window)
            reset_masks(model)
            torch.manual_seed(seed)  # Compactor's leverage scores draw a Gaussian sketch
            if press is not None and press_name not in shared:
                cache, logits = prefill(model, ids, press, None)
            else:
                cache, logits = copy.deepcopy(base), base_logits
                if press is not None:
                    compress_cache(press, model, cache, captured)
            kept, stored = kv_counts(model, cache)
            rec: dict[str, Any] = {
                "id": task.get("id"),
                "kind": task["kind"],
                "length": task["length"],
                "rate": rate,
                "compression_ratio": 0.0 if press is None else 1.0 - 1.0 / rate,
                "kept_kvs": kept,
                "full_kvs": full,
                "stored_kvs": stored,
            }
            if cont:
                rec["nll"], rec["teacher_forcing"] = continuation_nll(
                    model, cache, logits, rest, len(ids)
                )
                rec["num_tokens"] = len(rest)
            else:
                out_ids = greedy(model, cache, logits, len(ids), n_new)
                text = tok.decode(out_ids, skip_special_tokens=True)
                rec.update(output=text, output_ids=out_ids)
                if "answer" in task:
                    rec["correct"] = str(task["answer"]) in text
            _sync(model)
            rec["seconds"] = time.perf_counter() - t0
            rec["prefill_seconds"] = prefill_s if press_name in shared else None
            records.append(rec)
            del cache
        out[press_name] = records
    reset_masks(model)
    return out


def read_tasks(path: str) -> list[dict]:
    """Tasks as written by ``benchmarks/kvcompress_tasks.write_tasks`` (or ``{"tasks": [...]}``);
    a task without ``id`` gets its index."""
    data = json.loads(Path(path).read_text())
    tasks = list(data["tasks"] if isinstance(data, dict) else data)
    for i, t in enumerate(tasks):
        t.setdefault("id", i)
    return tasks


def _mark(rec: dict, task: dict) -> str:
    """For the progress line: the rounded NLL (continuation), ``1`` / ``0`` (``answer``), else
    how many of ``answers`` the output contains (case-insensitive; the caller scores)."""
    if "nll" in rec:
        return f"{rec['nll']:.3f}"
    if "correct" in rec:
        return str(int(rec["correct"]))
    answers = [str(a).lower() for a in task.get("answers", [])]
    return f"{sum(a in rec['output'].lower() for a in answers)}/{len(answers)}"


def main() -> None:
    """Run the press(es) over all tasks and rates; write one JSON per press."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="HF folder (safetensors)")
    ap.add_argument("--tasks", required=True, help="JSON list of tasks (see the docstring)")
    ap.add_argument(
        "--press",
        required=True,
        help=f"one of {', '.join(PRESSES)}, or several comma-separated (sharing each task's "
        "prefill; then --out must contain {press})",
    )
    ap.add_argument("--ratios", default="2,4,8,16,32,64", help="compression rates (1/kept)")
    ap.add_argument("--window", type=int, default=32, help="observation window (tokens)")
    ap.add_argument("--new-tokens", type=int, default=NEW_TOKENS, help="unless a task says")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--attn", default="sdpa", help="attention implementation (AdaKV: not eager)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument(
        "--site",
        default=None,
        help="folder put first on sys.path before the imports (kvpress_gpu_setup.sh's)",
    )
    ap.add_argument(
        "--literal",
        action="store_true",
        help="prefill under the press for every press and rate (slower, same results)",
    )
    ap.add_argument("--seed", type=int, default=0, help="torch seed before each compression")
    ap.add_argument("--limit", type=int, default=0, help="first N tasks only (0: all)")
    ap.add_argument("--out", required=True, help="result JSON ({press} is replaced)")
    args = ap.parse_args()
    presses = [p for p in args.press.split(",") if p]
    bad = [p for p in presses if p not in PRESSES]
    if bad or not presses:
        ap.error(f"unknown press {bad}; choose from {PRESSES}")
    if len(presses) > 1 and "{press}" not in args.out:
        ap.error("several presses need --out with a {press} placeholder")
    if args.threads:
        torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()
    rates = [int(r) for r in args.ratios.split(",") if r]
    tasks = read_tasks(args.tasks)[: args.limit or None]
    t_load = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=getattr(torch, args.dtype), attn_implementation=args.attn
    )
    model = model.to(args.device).eval()
    load_s = time.perf_counter() - t_load
    skipped = {p: why for p in presses if (why := unsupported(p, model))}
    for p, why in skipped.items():
        print(f"skipping {p}: {why}", file=sys.stderr)
    running = [p for p in presses if p not in skipped]
    results: dict[str, list[dict]] = {p: [] for p in presses}
    t_all = time.perf_counter()
    with torch.inference_mode():
        for n, task in enumerate(tasks, 1):
            t0 = time.perf_counter()
            by_press = run_task(
                model,
                tok,
                task,
                running,
                rates,
                args.window,
                args.new_tokens,
                args.literal,
                args.seed,
            )
            parts = []
            for p, recs in by_press.items():
                results[p] += recs
                marks = [f"{r['rate']}x:{_mark(r, task)}" for r in recs]
                parts.append(f"{p} {' '.join(marks)}")
            head = f"task {n}/{len(tasks)} {task['kind']} {task['length']}"
            tail = f"({time.perf_counter() - t0:.1f}s)"
            print(f"{head}: {' | '.join(parts)} {tail}", file=sys.stderr, flush=True)
    total_s = time.perf_counter() - t_all
    versions = {k: md.version(k) for k in ("kvpress", "transformers", "tokenizers", "torch")}
    device = torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else "cpu"
    for p in presses:
        press = make_press(p, rates[0], args.window) if rates and p not in skipped else None
        out = {
            "peer": "kvpress",
            "press": p,
            "knobs": repr(press) if press is not None else None,
            "skipped": skipped.get(p),
            "model": os.path.basename(os.path.normpath(args.model)),
            "model_class": type(model).__name__,
            "compressed_layers": compressed_layers(model),
            "num_key_value_heads": model.config.num_key_value_heads,
            "window": args.window,
            "seed": args.seed,
            "ratios": rates,
            "new_tokens": args.new_tokens,
            "attn_implementation": args.attn,
            "dtype": args.dtype,
            "device": device,
            "mode": "literal" if args.literal or is_literal(p) else "shared_prefill",
            "presses_in_run": presses,
            "threads": torch.get_num_threads(),
            "versions": versions,
            "machine": platform.machine(),
            "load_seconds": load_s,
            "total_seconds": total_s,
            "results": results[p],
        }
        if any(math.isnan(r.get("nll", 0.0)) for r in results[p]):
            print(f"warning: NaN nll ({p})", file=sys.stderr)
        path = args.out.replace("{press}", p)
        Path(path).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {path} ({len(results[p])} records, {total_s:.1f}s)", file=sys.stderr)


if __name__ == "__main__":
    main()
