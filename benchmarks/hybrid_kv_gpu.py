"""The hybrid KV manager on a GPU: Gemma-3-270M's shape (random bf16 weights), 8K-token
prompts in a fixed KV-cache budget, hybrid against one table for every layer
(``disable_hybrid_kv_cache_manager``), in one process: how many requests run at once, the
throughput, and the tokens of both (they should agree where bf16 ties allow).

Usage (GPU)::

    python benchmarks/hybrid_kv_gpu.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import time

import numpy as np
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.worker.profiler import DeviceTimer


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run(
    hybrid: bool,
    prompts: list[list[int]],
    out_len: int,
    kv_bytes: int,
    max_seqs: int = 128,
    profile: bool = False,
) -> dict:
    llm = LLM(
        "gemma-3-270m",
        load_format="dummy",
        dtype="bfloat16",
        max_model_len=len(prompts[0]) + out_len,
        kv_cache_memory_bytes=kv_bytes,
        max_num_seqs=max_seqs,
        enable_prefix_caching=False,
        disable_hybrid_kv_cache_manager=not hybrid,
    )
    core = llm.llm_engine.engine_core
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    # warm-up: the whole workload with other token ids, so every Triton specialization the
    # timed run meets is compiled first (whichever engine runs first)
    warm = [[(t + 1) % 250_000 for t in p] for p in prompts]
    llm.generate([{"prompt_token_ids": p} for p in warm], params, use_tqdm=False)
    sched = core.scheduler
    most = [0]
    schedule = sched.schedule

    def counting_schedule():  # noqa: ANN202
        out = schedule()
        most[0] = max(most[0], len(sched.running))
        return out

    sched.schedule = counting_schedule
    runner = core.model_runner
    timer = runner.profiler = DeviceTimer()  # (records nothing off a GPU)
    _sync()
    prof = cProfile.Profile() if profile else None
    t = time.perf_counter()
    if prof is not None:
        prof.enable()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    _sync()
    elapsed = time.perf_counter() - t
    if prof is not None:
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(22)
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    kv = sched.kv_cache_manager
    res = {
        "manager": type(kv).__name__,
        "num_blocks": kv.num_blocks,
        "block_bytes": core.model_runner.kv_bytes_per_block(),
        "max_concurrent_requests": most[0],
        "preemptions": sched.num_preemptions,
        "elapsed_s": elapsed,
        "output_tokens_per_s": produced / elapsed,
        "total_tokens_per_s": (produced + sum(map(len, prompts))) / elapsed,
        "steps": len(timer.step_seconds),
        "device_s": sum(timer.step_seconds),  # CUDA events around each step's work
        "device_busy_fraction": sum(timer.step_seconds) / elapsed,
        "tokens": [o.outputs[0].token_ids for o in outs],
    }
    del llm, core, runner
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=8192)
    ap.add_argument("--out-len", type=int, default=128)
    ap.add_argument("--kv-gib", type=float, default=1.0)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--profile", action="store_true", help="host profile of each run, no JSON")
    ap.add_argument("--repeats", type=int, default=3, help="rounds over the three engines")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    prompts = [
        rng.integers(300, 260_000, size=args.prompt_len).tolist() for _ in range(args.num_prompts)
    ]
    kv_bytes = int(args.kv_gib * 2**30)
    res: dict = {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "workload": {
            "model": "gemma-3-270m shape, random weights, bf16",
            "num_prompts": args.num_prompts,
            "prompt_len": args.prompt_len,
            "output_len": args.out_len,
            "kv_cache_gib": args.kv_gib,
            "prefix_caching": False,
        },
    }
    if args.profile:  # the single table, then the hybrid cache at the same concurrency
        single = run(False, prompts, args.out_len, kv_bytes, profile=True)
        cap = single["max_concurrent_requests"]
        run(True, prompts, args.out_len, kv_bytes, max_seqs=cap, profile=True)
        return
    # Three engines, run in a rotating order over --repeats rounds (the first engine of a
    # process runs slower, whatever it is); each keeps its best round. The hybrid cache is also
    # run capped at the single table's concurrency: what the extra concurrency gains, apart
    # from the manager's own cost.
    single_cap = run(False, prompts[:8], args.out_len, kv_bytes)["max_concurrent_requests"]
    configs = {
        "single_table": (False, 128),
        "hybrid": (True, 128),
        "hybrid_capped_to_single_concurrency": (True, single_cap),
    }
    names = list(configs)
    rounds: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(args.repeats):
        for name in names[r % 3 :] + names[: r % 3]:
            hybrid, seqs = configs[name]
            rounds[name].append(run(hybrid, prompts, args.out_len, kv_bytes, seqs))
    for name in names:
        best = max(rounds[name], key=lambda x: x["output_tokens_per_s"])
        res[name] = {
            **best,
            "rounds_output_tokens_per_s": [x["output_tokens_per_s"] for x in rounds[name]],
        }
    s, h, capped = (res[n] for n in names)
    res["concurrency_gain"] = h["max_concurrent_requests"] / s["max_concurrent_requests"]
    res["throughput_gain"] = h["output_tokens_per_s"] / s["output_tokens_per_s"]
    res["capped_throughput_ratio"] = capped["output_tokens_per_s"] / s["output_tokens_per_s"]
    res["sequences_equal"] = sum(a == b for a, b in zip(h["tokens"], s["tokens"]))
    res["first_token_equal"] = sum(a[0] == b[0] for a, b in zip(h["tokens"], s["tokens"]))
    for r in (h, s, capped):
        r.pop("tokens")
    print(json.dumps(res, indent=1))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"hybrid_kv_gpu_{res['device'].replace(' ', '_')}.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
