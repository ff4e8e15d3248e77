"""Benchmark D, the KV-Compress paper's throughput experiment: our engine without KV-Compress
against it with KV-Compress at compression rates cr, on the same random prompts.

The paper's settings (vLLM's throughput benchmark in the fork): Llama-3.1-8B, 256 prompts,
input 6,000, output 500, EOS ignored, protected window 32, compression after the prompt and
under memory pressure only, and ``max_cache_tokens = max(128, ((input / cr) - 1) // 16 * 16)``
per rate. The KV cache is capped (``--kv-cache-memory-bytes``, 4 GiB ~ what an L4 leaves beside
the 8B model) or not. Each configuration is one ``pagedllm bench throughput`` run (its own
engine); the JSON gathers them with the speed-up over the uncompressed run, and a PNG plots
output tok/s and peak concurrency against cr (the fork's ``throughput_by_cr``).

    python benchmarks/kvcompress_throughput.py --num-prompts 64 --rates 8,64 --out DIR
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def max_cache_tokens(input_len: int, cr: float) -> int:
    """The paper's conversion of a rate into a per-head budget."""
    return max(128, int(((input_len / cr) - 1) // 16 * 16))


def _args(a: argparse.Namespace, **over: object) -> argparse.Namespace:
    from pagedllm.bench import throughput

    p = argparse.ArgumentParser()
    throughput.add_arguments(p)
    ns = p.parse_args([])
    ns.model, ns.load_format, ns.dtype = a.model, "dummy", "bfloat16"
    ns.num_prompts, ns.input_len, ns.output_len = a.num_prompts, a.input_len, a.output_len
    ns.max_model_len, ns.max_num_seqs = a.max_model_len, a.max_num_seqs
    ns.kv_cache_memory_bytes = a.kv_cache_memory_bytes
    ns.gpu_memory_utilization = 0.9
    for k, v in over.items():
        setattr(ns, k, v)
    return ns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=6000)
    ap.add_argument("--output-len", type=int, default=500)
    ap.add_argument("--max-model-len", type=int, default=19000)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=4 << 30)
    ap.add_argument("--rates", default="1,2,4,8,16,32,64")
    ap.add_argument("--protected-window-size", type=int, default=32)
    ap.add_argument("--out", default="benchmarks/results")
    a = ap.parse_args()
    import torch

    from pagedllm.bench import throughput

    runs: dict[str, dict] = {}
    base = throughput.run(_args(a))
    runs["uncompressed"] = base
    gc.collect()
    torch.cuda.empty_cache()
    for cr in [float(r) for r in a.rates.split(",")]:
        m = max_cache_tokens(a.input_len, cr)
        r = throughput.run(
            _args(a, enable_kvc=True, max_cache_tokens=m,
                  protected_window_size=a.protected_window_size)
        )  # fmt: skip
        r["cr"], r["max_cache_tokens"] = cr, m
        r["speedup_output"] = r["output_tokens_per_s"] / base["output_tokens_per_s"]
        r["speedup_total"] = r["total_tokens_per_s"] / base["total_tokens_per_s"]
        runs[f"kvc_cr{cr:g}"] = r
        print(f"cr {cr:g}: max_cache_tokens {m}, {r['output_tokens_per_s']:.0f} out tok/s "
              f"({r['speedup_output']:.2f}x), peak seqs {r['concurrent_seqs_peak']}",
              flush=True)  # fmt: skip
        gc.collect()
        torch.cuda.empty_cache()
    device = base["device"].replace(" ", "_")
    cap = "uncapped" if not a.kv_cache_memory_bytes else f"{a.kv_cache_memory_bytes >> 20}MiB"
    name = f"kvcompress_throughput_{os.path.basename(a.model)}_in{a.input_len}_{cap}_{device}"
    out = Path(a.out) / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    summary = {
        k: {
            key: v.get(key)
            for key in (
                "output_tokens_per_s",
                "total_tokens_per_s",
                "speedup_output",
                "concurrent_seqs_mean",
                "concurrent_seqs_peak",
                "preemptions",
                "max_cache_tokens",
                "elapsed_s",
            )  # fmt: skip
        }
        for k, v in runs.items()
    }
    out.write_text(json.dumps({"benchmark": "D", "args": vars(a), "summary": summary,
                               "runs": runs}, indent=1))  # fmt: skip
    print(json.dumps(summary, indent=1))
    try:
        _plot(runs, out.with_suffix(".png"))
    except ImportError:
        pass
    print("wrote", out, os.path.getsize(out))


def _plot(runs: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kvc = [r for k, r in runs.items() if k.startswith("kvc_")]
    xs = [r["cr"] for r in kvc]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    a1.plot(xs, [r["output_tokens_per_s"] for r in kvc], marker="o", label="KV-Compress")
    a1.axhline(runs["uncompressed"]["output_tokens_per_s"], ls="--", c="k", label="no KVC")
    a1.set_xscale("log", base=2)
    a1.set_xlabel("compression rate")
    a1.set_ylabel("output tok/s")
    a1.legend()
    a2.plot(xs, [r["concurrent_seqs_peak"] for r in kvc], marker="o", label="KVC peak seqs")
    a2.axhline(runs["uncompressed"]["concurrent_seqs_peak"], ls="--", c="k", label="no KVC")
    a2.set_xscale("log", base=2)
    a2.set_xlabel("compression rate")
    a2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
