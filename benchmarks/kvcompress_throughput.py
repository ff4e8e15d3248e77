"""Benchmark D, the KV-Compress paper's throughput experiment: our engine without KV-Compress
against it with KV-Compress at compression rates cr, on the same random prompts.

The paper's settings (vLLM's throughput benchmark in the fork): Llama-3.1-8B, 256 prompts,
input 6,000, output 500, EOS ignored, protected window 32, compression after the prompt and
under memory pressure only, and ``max_cache_tokens = max(128, ((input / cr) - 1) // 16 * 16)``
per rate. The KV cache is capped (``--kv-cache-memory-bytes``, 4 GiB ~ what an L4 leaves beside
the 8B model) or not. Each configuration is one ``pagedllm bench throughput`` run (its own
engine); the JSON gathers them with the speed-up over the uncompressed run, and a PNG plots
output tok/s and peak concurrency against cr (the fork's ``throughput_by_cr``).

    python benchmarks/kvcompress_throughput.py --rates 64,8 --out DIR

The result is ``kvcompress_throughput_<model>_in<input>[_prefix<n>]_<cache>[_fp8]_<device>.json``
(``_fp8``: ``--kv-cache-dtype fp8``, every run's cache in float8 e4m3);
runs compared with an earlier file's uncompressed run (``--baseline-json``: a device call too
short for the uncompressed run and every rate) add their rates to the name (``_cr64_cr4``).
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
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
    ns.prefix_len = a.prefix_len
    ns.max_num_batched_tokens = a.max_num_batched_tokens
    ns.gpu_memory_utilization = 0.9
    ns.kv_cache_dtype = a.kv_cache_dtype
    for k, v in over.items():
        setattr(ns, k, v)
    return ns


SUMMARY_KEYS = (
    "output_tokens_per_s",
    "total_tokens_per_s",
    "speedup_output",
    "concurrent_seqs_mean",
    "concurrent_seqs_peak",
    "preemptions",
    "max_cache_tokens",
    "elapsed_s",
    "startup_s",
    "steps",
    "host_syncs_per_step",
    "triton_compiles_timed",
    "triton_compile_s_timed",
    "device_ms_per_step_mean",
    "device_busy_fraction",
    "device_ms_per_decode_step",
    "device_s_decode_steps",
    "device_s_prefill_steps",
    "cuda_graphs",
    "enable_prefix_caching",
    "enable_chunked_prefill",
    "prefix_cache_hit_rate",
    "decode_free_ceiling",
    "fraction_of_ceiling",
    "compress_s_decode_steps",
    "compress_s_prefill_steps",
    "decode_steps_with_evictions",
    "device_ms_per_decode_step_without_evictions",
    "head_len_mean",
    "head_len_p50_p90_p99",
    "head_len_max",
    "layer_max_over_mean",
)


def _summary(r: dict) -> dict:
    out = {key: r.get(key) for key in SUMMARY_KEYS}
    kvc = r.get("kvc") or {}
    for key in ("compress_ms_per_step", "compress_ms_per_eviction_step", "eviction_steps",
                "prefix_copy_blocks", "metadata_bytes_per_kv", "kv_bytes"):  # fmt: skip
        if key in kvc:
            out[key] = kvc[key]
    return out


def save(a: argparse.Namespace, input_len: int, runs: dict[str, dict]) -> Path:
    """Write the runs so far (after every run: a call cut short keeps what it measured)."""
    # this call's device: its last run's (the uncompressed run may be another file's)
    device = list(runs.values())[-1]["device"].replace(" ", "_")
    cap = "uncapped" if not a.kv_cache_memory_bytes else f"{a.kv_cache_memory_bytes >> 20}MiB"
    model = os.path.basename(a.model)
    prefix = f"_prefix{a.prefix_len}" if a.prefix_len else ""
    rates = ""
    if a.baseline_json:  # the rest of a comparison whose uncompressed run is another file's
        rates = "".join(f"_cr{float(r):g}" for r in a.rates.split(",") if r)
    tok = f"_tok{a.max_num_batched_tokens}" if a.max_num_batched_tokens else ""
    kv = "_fp8" if a.kv_cache_dtype.startswith("fp8") else ""
    name = f"kvcompress_throughput_{model}_in{input_len}{prefix}_{cap}{tok}{kv}{rates}_{device}"
    out = Path(a.out) / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    summary = {k: _summary(v) for k, v in runs.items()}
    args = {**vars(a), "input_len": input_len}
    # the device machine's tree may carry a stale .git: the call names its commit
    commit = os.environ.get("PAGEDLLM_COMMIT")
    out.write_text(json.dumps({"benchmark": "D", "git_commit": commit, "args": args,
                               "summary": summary, "runs": runs}, indent=1))  # fmt: skip
    return out


def _run_one(ns: argparse.Namespace) -> dict:
    """One configuration in a fresh process (spawned): every engine's memory goes back with
    its process (8B engines in a row in one process do not all fit an 80 GB GPU)."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(_run_in_child, (ns,))


def _run_in_child(ns: argparse.Namespace) -> dict:
    from pagedllm.bench import throughput

    return throughput.run(ns)


def run_length(a: argparse.Namespace, input_len: int, rates: list[float]) -> dict[str, dict]:
    """Our uncompressed run, then KV-Compress at each rate (and eagerly at --eager-rates)."""
    import torch

    def clean() -> None:
        gc.collect()
        torch.cuda.empty_cache()

    runs: dict[str, dict] = {}
    if a.baseline_json:  # an earlier call's uncompressed run (its file and commit recorded)
        earlier = json.loads(Path(a.baseline_json).read_text())
        base = dict(earlier["runs"]["uncompressed"])
        base["from_earlier_call"] = {"file": os.path.basename(a.baseline_json),
                                     "git_commit": earlier.get("git_commit")}  # fmt: skip
    else:
        base = _run_one(_args(a, input_len=input_len))
    runs["uncompressed"] = base
    print(f"in {input_len} uncompressed: {base['output_tokens_per_s']:.0f} out tok/s, peak "
          f"seqs {base['concurrent_seqs_peak']}", flush=True)  # fmt: skip
    clean()
    ceiling = None
    if a.prefill_only:  # the prompts alone (1 token out), at the engine's default token budget
        pre = _run_one(_args(a, input_len=input_len, output_len=1, max_num_batched_tokens=None))
        ceiling = base["elapsed_s"] / pre["elapsed_s"]
        pre["decode_free_ceiling"] = ceiling
        runs["prefill_only"] = pre
        print(f"in {input_len} prefill only: {pre['elapsed_s']:.2f} s, decode-free ceiling "
              f"{ceiling:.2f}x", flush=True)  # fmt: skip
        clean()

    def parse(text: str) -> list[float]:
        return [float(r) for r in text.split(",") if r and r != "none"]

    # (cr, eager, prefix caching, chunked prefill); the variants first: a call cut short still
    # has the comparison the earlier calls lacked
    todo = [(cr, False, False, True) for cr in parse(a.no_prefix_caching_rates)]
    todo += [(cr, False, True, False) for cr in parse(a.no_chunked_prefill_rates)]
    todo += [(cr, False, True, True) for cr in rates]
    todo += [(cr, True, True, True) for cr in parse(a.eager_rates)]
    for cr, enforce_eager, caching, chunked in todo:
        m = max_cache_tokens(input_len, cr)
        name = f"kvc_cr{cr:g}" + ("_eager" if enforce_eager else "")
        name += "" if caching else "_no_prefix_caching"
        name += "" if chunked else "_no_chunked_prefill"
        prof = None
        if a.profile_dir:
            os.makedirs(a.profile_dir, exist_ok=True)
            prof = os.path.join(a.profile_dir, f"host_profile_in{input_len}_{name}.txt")
        r = _run_one(
            _args(a, input_len=input_len, enable_kvc=True, max_cache_tokens=m,
                  protected_window_size=a.protected_window_size, enforce_eager=enforce_eager,
                  profile_host=prof, enable_prefix_caching=caching,
                  kernel_profile=a.kernel_profile or None,
                  enable_chunked_prefill=chunked)
        )  # fmt: skip
        r["cr"], r["max_cache_tokens"] = cr, m
        r["speedup_output"] = r["output_tokens_per_s"] / base["output_tokens_per_s"]
        r["speedup_total"] = r["total_tokens_per_s"] / base["total_tokens_per_s"]
        if ceiling is not None:  # the elapsed-time speed-up over the one with decode free
            r["fraction_of_ceiling"] = base["elapsed_s"] / r["elapsed_s"] / ceiling
        runs[name] = r
        save(a, input_len, runs)
        kvc = r["kvc"] or {}
        print(f"in {input_len} {name}: max_cache_tokens {m}, {r['output_tokens_per_s']:.0f} out "
              f"tok/s ({r['speedup_output']:.2f}x), seqs mean {r['concurrent_seqs_mean']:.1f} / "
              f"peak {r['concurrent_seqs_peak']}, steps {r['steps']} (results first "
              f"{r.get('eviction_waits')}), "
              f"syncs/step {r['host_syncs_per_step']}, compress ms/step "
              f"{kvc.get('compress_ms_per_step')}, prefix copies {kvc.get('prefix_copy_blocks')}, "
              f"compress s decode/prefill steps {r.get('compress_s_decode_steps')} / "
              f"{r.get('compress_s_prefill_steps')}, decode step ms without evictions "
              f"{r.get('device_ms_per_decode_step_without_evictions')}, heads: mean "
              f"{r.get('head_len_mean')}, p50/90/99 {r.get('head_len_p50_p90_p99')}, max "
              f"{r.get('head_len_max')}, layer max/mean {r.get('layer_max_over_mean')}",
              flush=True)  # fmt: skip
        kp = r.get("kernel_profile")
        if kp:
            print(f"in {input_len} {name} kernels: {kp['steps']} steps from {kp['first_step']} "
                  f"({kp['decode_only_steps']} decode-only, {kp['running_mean']:.1f} running), "
                  f"{kp['device_ms_per_step']:.2f} ms a step, wall {kp.get('wall_ms_per_step')} "
                  f"ms, device busy {kp.get('device_busy_in_window')} (idle "
                  f"{kp.get('device_idle_ms_per_step')} ms a step, largest gaps "
                  f"{kp.get('device_largest_gaps_ms')} ms)", flush=True)  # fmt: skip
            for k in kp["top_ms_per_step"][:14]:
                print(f"in {input_len}   {k['ms']:.3f} ms x{k['calls_per_step']:.0f} {k['name']}")
        clean()
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=6000)
    ap.add_argument("--input-lens", default="", help="a sweep instead of --input-len: 500,2000")
    ap.add_argument("--output-len", type=int, default=500)
    ap.add_argument("--max-model-len", type=int, default=19000)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument(
        "--kv-cache-memory-bytes", type=int, default=4 << 30, help="0: uncapped (what the GPU has)"
    )
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto or fp8 (every run)")
    ap.add_argument("--rates", default="1,2,4,8,16,32,64")
    ap.add_argument("--eager-rates", default="", help="also run these rates without graphs")
    ap.add_argument("--prefix-len", type=int, default=0, help="a prefix every prompt shares")
    ap.add_argument(
        "--no-prefix-caching-rates", default="", help="also run these rates with prefix caching off"
    )
    ap.add_argument(
        "--no-chunked-prefill-rates",
        default="",
        help="also run these rates with chunked prefill off",
    )
    ap.add_argument("--protected-window-size", type=int, default=32)
    ap.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="the token budget of every run (default: the engine's); prompt chunks of this "
        "size ride with the decodes",
    )
    ap.add_argument(
        "--prefill-only",
        action="store_true",
        help="also time the prompts alone (1 token out, the default budget): the decode-free "
        "ceiling, uncompressed time / prompts' time, and each rate's fraction of it",
    )
    ap.add_argument("--profile-dir", default="", help="cProfile each KVC run's host side")
    ap.add_argument(
        "--kernel-profile",
        default="",
        metavar="START:COUNT",
        help="each KVC run: device time by kernel over COUNT steps from step START",
    )
    ap.add_argument(
        "--baseline-json",
        default="",
        help="take the uncompressed run from this earlier result file instead of running it "
        "(A/B of KV-Compress variants in one call; the ratios are then across calls)",
    )
    ap.add_argument("--out", default="benchmarks/results")
    a = ap.parse_args()
    rates = [float(r) for r in a.rates.split(",") if r]
    lengths = [int(x) for x in a.input_lens.split(",")] if a.input_lens else [a.input_len]
    for input_len in lengths:
        runs = run_length(a, input_len, rates)
        out = save(a, input_len, runs)
        print(json.dumps({k: _summary(v) for k, v in runs.items()}, indent=1))
        try:
            _plot(runs, out.with_suffix(".png"))
        except ImportError:
            pass
        print("wrote", out, os.path.getsize(out), flush=True)


def _plot(runs: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kvc = [r for k, r in runs.items() if k.startswith("kvc_") and "_" not in k[4:]]
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
