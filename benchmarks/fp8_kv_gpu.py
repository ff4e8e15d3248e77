"""fp8 KV cache speed on one GPU (issue 56): Benchmark B's shapes on the Llama-3.1-8B shape
(random weights, bf16), the KV cache in bf16 against fp8 at equal KV memory
(``--kv-gib``), in one call, with HF transformers' generate on a subset as the peer.

At equal memory an fp8 cache holds twice the tokens, so about twice the sequences run at
once where the bf16 cache limits the batch, and each decode step reads half the KV bytes. Per
workload the JSON holds each engine's output tokens/s, the largest decode batch (sequences
in flight), its KV blocks, its fraction of the bandwidth/compute roofline (the roofline of its
own KV dtype: fp8 reads one byte an element), the device time of decode and prefill steps,
and the fp8 / bf16 ratio.

    python -P benchmarks/fp8_kv_gpu.py --out benchmarks/results

writes ``fp8_kv_bench-b_<device>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_suite import (  # noqa: E402
    device_tag,
    free_mem,
    hf_peer,
    phase_split,
    provenance,
)
from benchmarks.peers import hf_gpu  # noqa: E402
from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.bench.roofline import (  # noqa: E402
    measure_copy_bandwidth,
    measure_matmul_flops,
    model_cost,
    roofline,
)
from pagedllm.bench.throughput import StepRecorder  # noqa: E402
from pagedllm.worker.profiler import DeviceTimer  # noqa: E402


def run_engine(args, kv: str, shapes, bw: float, flops: float) -> dict:  # noqa: ANN001
    llm = LLM(args.model, load_format="dummy", dtype="bfloat16", max_model_len=2048,
              max_num_seqs=args.max_num_seqs, kv_cache_memory_bytes=int(args.kv_gib * 2**30),
              kv_cache_dtype=kv)  # fmt: skip
    runner = llm.llm_engine.engine_core.model_runner
    out: dict = {"kv_cache_dtype": kv, "kv_cache_blocks": runner.num_blocks,
                 "kv_bytes_per_block": runner.kv_bytes_per_block()}  # fmt: skip
    cost = model_cost(runner.model, torch.bfloat16, runner.kv_dtype)
    for n_in, n_out in shapes:
        rng = np.random.default_rng(0)
        prompts = [rng.integers(100, 128000, size=n_in).tolist() for _ in range(args.num)]
        warm = [rng.integers(100, 128000, size=n_in).tolist() for _ in range(args.warm)]
        llm.generate([{"prompt_token_ids": p} for p in warm],
                     SamplingParams(temperature=0, max_tokens=min(n_out, 16), ignore_eos=True),
                     use_tqdm=False)  # fmt: skip
        llm.llm_engine.engine_core.scheduler.kv_cache_manager.reset_prefix_cache()
        rec = StepRecorder(llm)
        timer = runner.profiler = DeviceTimer()
        torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts],
                     SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True),
                     use_tqdm=False)  # fmt: skip
        torch.cuda.synchronize()
        el = time.perf_counter() - t
        runner.profiler = None
        roof = roofline(rec.steps, cost, bw, flops)
        dev = timer.step_seconds
        n_tok = args.num * n_out
        decode_batches = [len(s.num_tokens) for s in rec.steps if max(s.num_tokens) == 1]
        out[f"in{n_in}_out{n_out}"] = {
            "num_prompts": args.num, "elapsed_s": el, "output_tokens_per_s": n_tok / el,
            "total_tokens_per_s": args.num * (n_in + n_out) / el,
            "roofline_fraction": roof.ideal_s / el, "steps": len(rec.steps),
            "max_decode_batch": max(decode_batches, default=0),
            "mean_decode_batch": float(np.mean(decode_batches)) if decode_batches else 0.0,
            "preemptions": llm.llm_engine.engine_core.scheduler.num_preemptions,
            "device_busy_fraction": float(np.sum(dev)) / el if dev else None,
            "phases": phase_split(rec.steps, dev, cost, bw, flops),
        }  # fmt: skip
        print(json.dumps({kv: out[f"in{n_in}_out{n_out}"]}), flush=True)
        llm.llm_engine.engine_core.scheduler.kv_cache_manager.reset_prefix_cache()
    del llm, runner, rec
    free_mem()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--shapes", default="1024x128,128x1024")
    ap.add_argument("--num", type=int, default=500, help="prompts per workload")
    ap.add_argument("--warm", type=int, default=256, help="warm-up prompts (16 tokens out)")
    ap.add_argument("--kv-gib", type=float, default=12.0, help="KV memory of both engines")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--peer-num", type=int, default=32, help="HF peer prompts (0: none)")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    result: dict = {**provenance("fp8-kv-B"), "model": args.model, "args": vars(args)}
    bw = measure_copy_bandwidth(torch.device("cuda"))
    flops = measure_matmul_flops(torch.device("cuda"))
    result["copy_bandwidth_GBps"] = bw / 1e9
    result["matmul_bf16_TFLOPs"] = flops / 1e12
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"fp8_kv_bench-b_{device_tag()}.json")
    engines: dict = {}
    result["engines"] = engines
    for kv in ("auto", "fp8"):  # each engine's numbers saved as they come (a time limit)
        engines[kv] = run_engine(args, kv, shapes, bw, flops)
        with open(path + ".partial", "w") as f:
            json.dump(result, f, indent=1)
    for n_in, n_out in shapes:
        key = f"in{n_in}_out{n_out}"
        a, b = engines["auto"][key], engines["fp8"][key]
        result[key] = {
            "bf16_output_tokens_per_s": a["output_tokens_per_s"],
            "fp8_output_tokens_per_s": b["output_tokens_per_s"],
            "fp8_over_bf16": b["output_tokens_per_s"] / a["output_tokens_per_s"],
            "max_decode_batch": {"bf16": a["max_decode_batch"], "fp8": b["max_decode_batch"]},
            "roofline_fraction": {"bf16": a["roofline_fraction"], "fp8": b["roofline_fraction"]},
        }
    if args.peer_num:
        model = hf_peer(args.model)
        for n_in, n_out in shapes:
            rng = np.random.default_rng(0)
            sub = [rng.integers(100, 128000, size=n_in).tolist() for _ in range(args.peer_num)]
            try:
                r = hf_gpu.static_generate(model, sub, [n_out] * len(sub))
                r["num_prompts"] = len(sub)
            except Exception as e:  # a failing peer must not lose the engines' numbers
                r = {"error": repr(e)[:300]}
            key = f"in{n_in}_out{n_out}"
            result[key]["hf_generate"] = r
            if "output_tokens_per_s" in r:
                for kv in ("bf16", "fp8"):
                    ours = result[key][f"{kv}_output_tokens_per_s"]
                    result[key][f"{kv}_over_hf_generate"] = ours / r["output_tokens_per_s"]
            print(json.dumps({key: result[key]}), flush=True)
        del model
        free_mem()
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
