"""The kvpress peer (NVIDIA kvpress 0.5.5) on the KV-Compress quality tasks, on token ids.

Runs INSIDE the kvpress venv (``benchmarks/peers/kvpress_setup.sh`` makes /tmp/kvpress_venv;
kvpress pins transformers<5.3) and imports only kvpress, transformers, torch and the stdlib::

    /tmp/kvpress_venv/bin/python benchmarks/peers/kvpress_run.py --model HF_DIR \\
        --tasks tasks.json --press adakv_snapkv|snapkv|none --ratios 2,4,8,16,32,64 \\
        --window 32 --out result.json

Tasks come from ``benchmarks/kvcompress_tasks.py`` (a JSON list). For every task and rate ``cr``
the press gets ``compression_ratio = 1 - 1/cr``:

* ``snapkv``: ``SnapKVPress(compression_ratio, window_size=--window)`` (kernel 5, kvpress's
  default). It scores the keys by the attention of the last ``window`` queries (mean over the
  window and over the query heads of a KV group, 1-D average pooling), gives the window's own
  keys the maximum score + 1 and keeps the top ``int(k_len * (1 - ratio))`` keys per KV head,
  the window included: the cache is physically shortened, the same length in every head.
* ``adakv_snapkv``: ``AdaKVPress(SnapKVPress(...))`` (alpha_safeguard 0.2): the same scores,
  ranked across the KV heads of a layer (each head first keeps its top ``0.2 * n_kept``), so heads
  keep different numbers of KVs. Nothing is removed: the pruned keys are masked at attention
  time (kvpress's attention patch overwrites them with a fake key whose scaled dot product with
  the current queries is very negative), so their count is what this script reports as evicted.
* ``none``: the full cache (one record per task, ``rate`` 1).

Fairness (same as our engine's side): the WHOLE prompt (``prompt_ids``: context + question) is
prefilled and compressed, so the observation window is the last ``window`` prompt tokens, the
question's included; greedy decoding (``--new-tokens``, default 12, EOS ignored) then runs on the
compressed cache. kvpress compresses a layer's cache in a forward hook after that layer's
attention, so the prefill's own outputs (and the first generated token) see the full prompt.
Continuation tasks: the context (``prompt_ids[:context_len]``) is prefilled and compressed, then
the continuation is teacher-forced; the mean NLL per continuation token is reported (its first
token is predicted by the context's last logits, as our engine's ``prompt_logprobs`` do).

Since compression happens after each layer's attention, the prefill (hidden states, logits) does
not depend on the press: by default the prompt is prefilled ONCE per task with the full cache and
each rate compresses a copy of that cache by calling the press's own ``compress`` with the
captured attention inputs, exactly what kvpress's ``forward_hook`` does (``--literal`` instead
runs ``with press(model): model(prompt)`` for every rate; both give the same tokens and counts).
Several presses in one call (``--press adakv_snapkv,snapkv,none --out res_{press}.json``) also
share that prefill and write one JSON per press.

Gemma 3 (``Gemma3ForCausalLM``): only the global (full attention) layers are compressed, the
sliding-window layers are untouched (kvpress does the same for ``Gemma3ForConditionalGeneration``
only), and the KV counts cover the global layers only. KV counts are summed over the compressed
layers and their KV heads: ``kept_kvs`` (unmasked KVs for AdaKV) and ``full_kvs``. Gemma-3-270M
has ONE KV head per layer, so AdaKV (which only reallocates across the heads of a layer) selects
exactly what SnapKV selects there.

The output JSON has ``results``: one record per task and rate with ``id``, ``kind``, ``length``,
``rate``, ``compression_ratio``, ``correct`` / ``output`` / ``output_ids`` (retrieval) or ``nll``
(continuation), ``kept_kvs``, ``full_kvs``, ``stored_kvs`` (what the cache physically holds:
AdaKV stores every KV) and ``seconds`` (compression + decoding at this rate; ``prefill_seconds``
separately).
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata as md
import json
import math
import os
import platform
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import kvpress  # noqa: F401  (importing kvpress patches the attention functions for AdaKV)
import torch
from kvpress import AdaKVPress, BasePress, SnapKVPress
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.masking_utils import create_sliding_window_causal_mask
from transformers.utils import logging as hf_logging

PRESSES = ("adakv_snapkv", "snapkv", "none")
NEW_TOKENS = 12


def make_press(name: str, rate: float, window: int) -> BasePress | None:
    """The kvpress press for ``name`` at compression rate ``rate`` (``None`` for ``none``)."""
    if name == "none":
        return None
    snap = SnapKVPress(compression_ratio=1.0 - 1.0 / rate, window_size=window)
    if name == "snapkv":
        return snap
    if name == "adakv_snapkv":
        return AdaKVPress(snap)
    raise ValueError(f"unknown press {name!r}; choose from {PRESSES}")


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
    layers = decoder_layers(model)
    inner = model.model.language_model if hasattr(model.model, "language_model") else model.model
    hooks = []
    try:
        for i in compressed_layers(model):
            attn = layers[i].self_attn
            attn.rotary_emb = inner.rotary_emb
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
    input_ids = torch.tensor([ids], dtype=torch.long)
    position_ids = torch.arange(pos0, pos0 + q, dtype=torch.long).unsqueeze(0)
    kwargs: dict[str, Any] = {}
    if is_hybrid(model):
        cache_position = torch.arange(pos0, pos0 + q, dtype=torch.long)
        kwargs["cache_position"] = cache_position
        if q > 1:
            g = compressed_layers(model)[0]
            k = cache.layers[g].get_seq_length()
            full = torch.ones(q, k + q, dtype=torch.bool)
            full[:, k:] = torch.tril(torch.ones(q, q, dtype=torch.bool))
            embeds = torch.zeros(1, q, model.config.hidden_size, dtype=model.dtype)
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
        input_ids = torch.tensor([ids], dtype=torch.long)
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
    prefill's last logits). One forward for the rest; if AdaKV's fake-key search fails for that
    many queries (ValueError), token by token on a fresh copy of the cache instead."""
    nll = [-float(torch.log_softmax(first_logits.float(), -1)[cont[0]])]
    backup = copy.deepcopy(cache)
    try:
        logits = forward(model, cache, cont[:-1], pos0)
        mode = "one_forward"
    except ValueError:
        cache = backup
        rows = [forward(model, cache, [t], pos0 + i)[-1] for i, t in enumerate(cont[:-1])]
        logits = torch.stack(rows)
        mode = "per_token"
    lp = torch.log_softmax(logits.float(), -1)
    nll += [-float(lp[i, t]) for i, t in enumerate(cont[1:])]
    return sum(nll) / len(nll), mode


def run_task(
    model: Any,
    tok: Any,
    task: dict,
    presses: list[str],
    rates: list[int],
    window: int,
    new_tokens: int,
    literal: bool,
) -> dict[str, list[dict]]:
    """All presses and rates of one task: per press, one record per rate (one, ``rate`` 1, for
    ``none``). Without ``literal`` the presses share one full-cache prefill."""
    cont = task["kind"] == "continuation"
    ids = task["prompt_ids"][: task["context_len"]] if cont else task["prompt_ids"]
    rest = task["prompt_ids"][task["context_len"] :] if cont else []
    captured: dict[int, dict] = {}
    base = base_logits = None
    prefill_s = 0.0
    if "none" in presses or not literal:
        t0 = time.perf_counter()
        base, base_logits = prefill(model, ids, None, None if literal else captured)
        prefill_s = time.perf_counter() - t0
    full = len(compressed_layers(model)) * model.config.num_key_value_heads * len(ids)
    out: dict[str, list[dict]] = {}
    for press_name in presses:
        records = []
        for rate in [1] if press_name == "none" else rates:
            t0 = time.perf_counter()
            press = make_press(press_name, rate, window)
            reset_masks(model)
            if press is not None and literal:
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
                out_ids = greedy(model, cache, logits, len(ids), new_tokens)
                text = tok.decode(out_ids, skip_special_tokens=True)
                rec.update(correct=task["answer"] in text, output=text, output_ids=out_ids)
            rec["seconds"] = time.perf_counter() - t0
            rec["prefill_seconds"] = prefill_s
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


def _mark(rec: dict) -> str:
    """``1`` / ``0`` for a retrieval record, the rounded NLL for a continuation one."""
    return str(int(rec["correct"])) if "correct" in rec else f"{rec['nll']:.3f}"


def main() -> None:
    """Run the press(es) over all tasks and rates; write one JSON per press."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="HF folder (float32 safetensors)")
    ap.add_argument("--tasks", required=True, help="JSON list from kvcompress_tasks.py")
    ap.add_argument(
        "--press",
        required=True,
        help=f"one of {', '.join(PRESSES)}, or several comma-separated (sharing each task's "
        "prefill; then --out must contain {press})",
    )
    ap.add_argument("--ratios", default="2,4,8,16,32,64", help="compression rates (1/kept)")
    ap.add_argument("--window", type=int, default=32, help="observation window (tokens)")
    ap.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    ap.add_argument("--attn", default="sdpa", help="attention implementation (AdaKV: not eager)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument(
        "--literal",
        action="store_true",
        help="prefill under the press for every rate (slower, same results)",
    )
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
        args.model, dtype=torch.float32, attn_implementation=args.attn
    ).eval()
    load_s = time.perf_counter() - t_load
    results: dict[str, list[dict]] = {p: [] for p in presses}
    t_all = time.perf_counter()
    with torch.inference_mode():
        for n, task in enumerate(tasks, 1):
            t0 = time.perf_counter()
            by_press = run_task(
                model, tok, task, presses, rates, args.window, args.new_tokens, args.literal
            )
            parts = []
            for p, recs in by_press.items():
                results[p] += recs
                marks = [f"{r['rate']}x:{_mark(r)}" for r in recs]
                parts.append(f"{p} {' '.join(marks)}")
            head = f"task {n}/{len(tasks)} {task['kind']} {task['length']}"
            tail = f"({time.perf_counter() - t0:.1f}s)"
            print(f"{head}: {' | '.join(parts)} {tail}", file=sys.stderr, flush=True)
    total_s = time.perf_counter() - t_all
    for p in presses:
        out = {
            "peer": "kvpress",
            "press": p,
            "model": os.path.basename(os.path.normpath(args.model)),
            "model_class": type(model).__name__,
            "compressed_layers": compressed_layers(model),
            "num_key_value_heads": model.config.num_key_value_heads,
            "window": args.window,
            "kernel_size": 5,
            "alpha_safeguard": 0.2 if p == "adakv_snapkv" else None,
            "ratios": rates,
            "new_tokens": args.new_tokens,
            "attn_implementation": args.attn,
            "mode": "literal" if args.literal else "shared_prefill",
            "presses_in_run": presses,
            "threads": torch.get_num_threads(),
            "versions": {k: md.version(k) for k in ("kvpress", "transformers", "torch")},
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
