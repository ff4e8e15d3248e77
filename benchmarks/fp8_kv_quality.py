"""fp8 KV-cache quality on real weights (issue 56): the same model, the same token ids, the
cache in the model's dtype against the cache in fp8 (fixed scales 1.0, and scales calibrated
on the first step: ``calculate_kv_scales``).

For SmolLM2-135M-Instruct and Gemma-3-270M (HF folders from ``benchmarks/models.py``):

- greedy agreement: ``--num-prompts`` windows of held-out text (the stdlib's pydoc topics that
  the KV-Compress quality suite holds out, ``benchmarks/kvcompress_tasks.py``), each
  ``--prompt-len`` tokens, ``--max-tokens`` greedy tokens; the fraction of outputs equal to the
  reference cache's, the mean fraction of tokens before the first divergence, and the
  position-wise token agreement;
- teacher-forced loss: ``--num-windows`` windows of ``--window`` held-out tokens, the mean
  negative log-likelihood per token of each window's second half (prompt logprobs: every
  token of the window attends to the quantized cache), each method against the reference:
  the relative difference (the issue's goal: within 1%) with a 95% paired bootstrap interval.

A fourth engine, the reference cache with prompts computed in 64-token chunks, is the noise
floor: the same arithmetic in other roundings, so its agreement with the reference says how
much of a greedy output's drift any change of rounding causes (a bfloat16 model's greedy
continuation parts at the first near-tie of its logits).

    python -P benchmarks/fp8_kv_quality.py --out benchmarks/results/fp8_kv_quality_cpu.json

On a GPU (``--device cuda``) the model runs in bfloat16, as on a CPU by default; the JSON
names the device. Nothing here is timed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))

METHODS = {  # name -> engine arguments over the reference's
    "auto": {},
    # the noise floor: the same cache, prompts in 64-token chunks (other roundings of the same
    # sums): how far greedy outputs drift from rounding alone
    "auto_chunked": {"max_num_batched_tokens": 64, "enable_chunked_prefill": True},
    "fp8": {"kv_cache_dtype": "fp8"},
    "fp8_calibrated": {"kv_cache_dtype": "fp8", "calculate_kv_scales": True},
}


def model_dir(name: str) -> str:
    from benchmarks import models

    return str({"smollm2": models.smollm2_hf_dir, "gemma3": models.gemma3_270m_hf_dir}[name]())


def held_out_windows(tokenizer: Any, num: int, length: int) -> list[list[int]]:
    """``num`` windows of ``length`` token ids spread evenly over the held-out text (with the
    tokenizer's leading specials, e.g. Gemma's <bos>)."""
    from benchmarks.kvcompress_tasks import _encode, _leading_specials, topics_text

    ids = _encode(tokenizer, topics_text()[1])
    lead = _leading_specials(tokenizer)
    body = length - len(lead)
    if len(ids) < body + num:
        raise ValueError(f"held-out text has {len(ids)} tokens; {num} windows of {body} need more")
    starts = np.linspace(0, len(ids) - body, num).astype(int)
    return [lead + ids[s : s + body] for s in starts]


def greedy(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def window_nll(llm: Any, windows: list[list[int]]) -> np.ndarray:
    """Mean NLL per token of each window's second half, the window as the prompt."""
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": w} for w in windows], params, use_tqdm=False)
    nll = []
    for o, w in zip(outs, windows):
        half = len(w) // 2
        nll.append(-np.mean([o.prompt_logprobs[i][w[i]].logprob for i in range(half, len(w))]))
    return np.array(nll)


def agreement(ref: list[list[int]], got: list[list[int]]) -> dict[str, float]:
    same, prefix, pos = [], [], []
    for a, b in zip(ref, got):
        n = len(a)
        first = next((i for i in range(n) if a[i] != b[i]), n)
        same.append(first == n)
        prefix.append(first / n)
        pos.append(np.mean([x == y for x, y in zip(a, b)]))
    return {
        "exact_outputs": float(np.mean(same)),
        "prefix_fraction": float(np.mean(prefix)),
        "token_agreement": float(np.mean(pos)),
    }


def relative_loss(ref: np.ndarray, got: np.ndarray, boot: int, seed: int = 0) -> dict[str, Any]:
    """(mean got - mean ref) / mean ref, with a 95% paired bootstrap interval over windows."""
    rng = np.random.default_rng(seed)
    rel = float(got.mean() / ref.mean() - 1)
    idx = rng.integers(0, len(ref), size=(boot, len(ref)))
    samples = got[idx].mean(axis=1) / ref[idx].mean(axis=1) - 1
    lo, hi = np.percentile(samples, [2.5, 97.5])
    return {"relative": rel, "ci95": [float(lo), float(hi)], "within_1pct": abs(rel) <= 0.01}


def run_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from pagedllm import LLM

    path = model_dir(name)
    results: dict[str, Any] = {"model": name, "path": os.path.basename(path), "methods": {}}
    prompts = windows = None
    ref_out: list[list[int]] = []
    ref_nll = np.zeros(0)
    for method, extra in METHODS.items():
        t0 = time.time()
        llm = LLM(
            path, dtype=args.dtype, device=args.device, seed=0,
            max_model_len=max(args.window, args.prompt_len + args.max_tokens) + 8,
            max_num_seqs=args.max_num_seqs, **extra,
        )  # fmt: skip
        if prompts is None:
            tok = llm.get_tokenizer()
            prompts = held_out_windows(tok, args.num_prompts, args.prompt_len)
            windows = held_out_windows(tok, args.num_windows, args.window)
        assert windows is not None
        # the calibrated scales come from this engine's first step: a fixed first prompt
        out = greedy(llm, prompts, args.max_tokens)
        nll = window_nll(llm, windows)
        runner = getattr(llm.llm_engine.engine_core.executor, "runner", None)
        scales = runner.kv_layout.scales if runner is not None else []
        row: dict[str, Any] = {
            "engine_args": extra,
            "mean_nll": float(nll.mean()),
            "nll": nll.tolist(),
            "seconds": round(time.time() - t0, 1),
        }
        if scales:
            flat = torch.cat([s.flatten().cpu() for s in scales])
            row["scales"] = {"min": float(flat.min()), "max": float(flat.max())}
        if method == "auto":
            ref_out, ref_nll = out, nll
        else:
            row["agreement"] = agreement(ref_out, out)
            row["loss_vs_auto"] = relative_loss(ref_nll, nll, args.boot)
        results["methods"][method] = row
        print(name, method, {k: v for k, v in row.items() if k not in ("nll",)}, flush=True)
        del llm
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-windows", type=int, default=32)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--boot", type=int, default=2000)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import torch

    from pagedllm.bench.throughput import device_name

    device = device_name(torch.device(args.device))
    if args.device == "cpu" and os.path.exists("/proc/cpuinfo"):  # the model, not "x86_64"
        names = [ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                 if ln.startswith("model name")]  # fmt: skip
        device = names[0] if names else device
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, check=False).stdout.strip() or None  # fmt: skip
    except OSError:
        commit = None
    report = {
        "benchmark": "fp8_kv_quality",
        "device": device,
        "host": platform.node(),
        "torch": torch.__version__,
        "git_commit": os.environ.get("PAGEDLLM_COMMIT") or commit,
        "args": vars(args),
        "models": [run_model(m, args) for m in args.models.split(",")],
    }
    Path(args.out).write_text(json.dumps(report, indent=1))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
