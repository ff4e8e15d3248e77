"""What KV-Compress costs a request without a budget, measured against the drift between runs.

Two engines live side by side in one process: KV-Compress off, and on with no budget (the
per-head layout, no eviction). Each is built and warmed up once; then the timed runs
alternate, off / on / on / off / off / on ..., so that a slow patch of the machine (the host's
clock, another tenant) falls on both alike. The overhead is the ratio of the summed
throughputs, with each pair's ratio beside it (their spread is the noise of one comparison).

  python benchmarks/kvcompress_overhead.py a --rounds 3 --out $OUT     # Benchmark A
  python benchmarks/kvcompress_overhead.py b --rounds 2 --out $OUT     # Benchmark B, both shapes

Both engines get the same explicit KV-cache size (``--kv-gib``), enough for every request of
the workload at once (no preemption), so the two fit on one GPU together. The prefix cache is
emptied before every timed run (the runs repeat the same prompts).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.gpu_suite import device_tag, make_hf_model, provenance  # noqa: E402
from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.bench.throughput import StepRecorder, make_workload  # noqa: E402
from pagedllm.worker.profiler import DeviceTimer  # noqa: E402

VARIANTS = {"off": {}, "kvc_never_evicts": {"enable_kvc": True}}


def _workloads(bench: str, num_b: int, shapes: list[tuple[int, int]]) -> dict[str, tuple]:
    """name -> (prompts, max_tokens per prompt, warm-up prompts, warm-up max_tokens)."""
    if bench == "a":  # Benchmark A: input and output lengths uniform in 100-1024
        prompts, outs = make_workload(256, 562, 562, 462 / 562, 151936, seed=0)
        warm, _ = make_workload(256, 562, 562, 462 / 562, 151936, seed=1)
        warm = [w[: len(p)] + [7] * (len(p) - len(w)) for w, p in zip(warm, prompts)]
        return {"a": (prompts, outs, warm, outs)}
    out = {}
    for n_in, n_out in shapes:
        rng = np.random.default_rng(0)
        prompts = [rng.integers(100, 128000, size=n_in).tolist() for _ in range(num_b)]
        # warm-up: the full batch with short outputs, so every step shape compiles before
        warm = [rng.integers(100, 128000, size=n_in).tolist() for _ in range(num_b)]
        out[f"in{n_in}_out{n_out}"] = (prompts, [n_out] * num_b, warm, [min(n_out, 32)] * num_b)
    return out


def _generate(llm: LLM, prompts: list, max_tokens: list[int]) -> int:
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs)


def _timed(llm: LLM, rec: StepRecorder, prompts: list, max_tokens: list[int]) -> dict:
    core = llm.llm_engine.engine_core
    core.scheduler.kv_cache_manager.reset_prefix_cache()
    runner = core.model_runner
    rec.steps.clear()
    rec.decode_host_s.clear()
    timer = runner.profiler = DeviceTimer()
    torch.cuda.synchronize()
    t = time.perf_counter()
    produced = _generate(llm, prompts, max_tokens)
    torch.cuda.synchronize()
    el = time.perf_counter() - t
    dev = timer.step_seconds
    runner.profiler = None
    return {"elapsed_s": el, "output_tokens": produced, "output_tokens_per_s": produced / el,
            "steps": len(rec.steps),
            "device_ms_per_step": 1e3 * float(np.mean(dev)) if dev else None,
            "host_ms_per_decode_step": 1e3 * float(np.mean(rec.decode_host_s or [0]))}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("bench", choices=["a", "b"])
    p.add_argument("--rounds", type=int, default=3, help="timed runs per engine and workload")
    p.add_argument("--b-shapes", default="128x1024,1024x128")
    p.add_argument("--num-b", type=int, default=256)
    p.add_argument("--kv-gib", type=float, default=0.0,
                   help="KV-cache size of each engine (default: A 40, B 40)")  # fmt: skip
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    shapes = [tuple(map(int, x.split("x"))) for x in args.b_shapes.split(",") if x]
    kv_bytes = int((args.kv_gib or 40.0) * 2**30)
    if args.bench == "a":
        model = make_hf_model("qwen3-0.6b", torch.bfloat16, "/tmp/qwen3_bfloat16")
        kw = {}
    else:
        model, kw = "llama-3.1-8b", {"load_format": "dummy"}
    result: dict = {**provenance(f"kvcompress-overhead-{args.bench}"), "rounds": args.rounds,
                    "kv_cache_memory_bytes": kv_bytes, "runs": {}}  # fmt: skip
    work = _workloads(args.bench, args.num_b, shapes)
    engines = {}
    for name, extra in VARIANTS.items():
        llm = LLM(model, dtype="bfloat16", max_model_len=2048, max_num_seqs=256,
                  kv_cache_memory_bytes=kv_bytes, **kw, **extra)  # fmt: skip
        for _, (_, _, warm, warm_out) in work.items():
            _generate(llm, warm, warm_out)
        engines[name] = (llm, StepRecorder(llm))
    names = list(VARIANTS)
    for wname, (prompts, outs, _, _) in work.items():
        runs: dict[str, list[dict]] = {n: [] for n in names}
        for r in range(args.rounds):
            # off, on | on, off | off, on ...: a drift in time weighs on both alike
            for name in names if r % 2 == 0 else names[::-1]:
                llm, rec = engines[name]
                row = _timed(llm, rec, prompts, outs)
                runs[name].append(row)
                print(wname, r, name, json.dumps(row), flush=True)
        tok = {n: sum(x["output_tokens"] for x in runs[n]) for n in names}
        sec = {n: sum(x["elapsed_s"] for x in runs[n]) for n in names}
        pairs = [b["output_tokens_per_s"] / a["output_tokens_per_s"]
                 for a, b in zip(runs["off"], runs["kvc_never_evicts"])]  # fmt: skip
        summary = {
            "off_output_tokens_per_s": tok["off"] / sec["off"],
            "kvc_output_tokens_per_s": tok["kvc_never_evicts"] / sec["kvc_never_evicts"],
            "pair_ratios": pairs,
            "off_run_spread": max(x["output_tokens_per_s"] for x in runs["off"])
            / min(x["output_tokens_per_s"] for x in runs["off"]),
        }
        summary["ratio"] = summary["kvc_output_tokens_per_s"] / summary["off_output_tokens_per_s"]
        result["runs"][wname] = {"summary": summary, **runs}
        print(wname, json.dumps(summary), flush=True)
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"kvcompress_overhead_{args.bench}_{device_tag()}.json")
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
    print("wrote", path)


if __name__ == "__main__":
    main()
