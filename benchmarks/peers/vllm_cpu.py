"""vLLM (CPU build) peer for the throughput benchmark.

Run with the peer venv's interpreter (never the project's), e.g.::

    VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_NUM_OF_RESERVED_CPU=0
    /work/peers/vllm/bin/python benchmarks/peers/vllm_cpu.py --model DIR
        --num-prompts 64 --input-len 128 --output-len 64 --out /tmp/vllm.json

It builds the same random-token prompts as every other engine (``benchmarks/workloads.py``),
runs vLLM's offline ``LLM.generate`` on ``TokensPrompt``s with greedy sampling and EOS ignored,
does one warm-up then ``--repeats`` timed runs, and writes a JSON with median throughput,
start-up time and the generated token ids.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

# Both must be set before vLLM is imported. Reserve no core for the scheduler: vLLM then computes
# on both cores of this machine, which is the fair comparison.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")

_WORKLOADS_PY = Path(__file__).resolve().parent.parent / "workloads.py"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line arguments shared by the peer scripts."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="HF model folder")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=0.0)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument(
        "--prefix-caching",
        action="store_true",
        help="keep vLLM's prefix cache on (off by default: the warm-up and every timed run send "
        "the same prompts, so a prefix cache would skip their prefill after the first run)",
    )
    p.add_argument("--out", required=True, help="where to write the result JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the workload under vLLM and write the result JSON."""
    args = parse_args(argv)
    wl: Any = _load_workloads()
    prompts = wl.random_prompts(
        args.num_prompts,
        args.input_len,
        wl.model_vocab_size(args.model),
        args.seed,
        args.range_ratio,
    )

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        seed=args.seed,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.prefix_caching,
    )
    startup_s = time.perf_counter() - t0

    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    requests = [TokensPrompt(prompt_token_ids=ids) for ids in prompts]

    def run_once() -> tuple[float, list[list[int]]]:
        start = time.perf_counter()
        outs = llm.generate(requests, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        return elapsed, [list(o.outputs[0].token_ids) for o in outs]

    warmup_s, token_ids = run_once()
    times: list[float] = []
    for _ in range(args.repeats):
        elapsed, ids = run_once()
        times.append(elapsed)
        if ids != token_ids:
            print("warning: vLLM greedy output changed between runs", file=sys.stderr)
        token_ids = ids

    import torch
    import transformers

    result = {
        "engine": "vllm",
        "model": str(args.model),
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "range_ratio": args.range_ratio,
        "dtype": args.dtype,
        "seed": args.seed,
        "repeats": args.repeats,
        "prefix_caching": args.prefix_caching,
        "startup_s": startup_s,
        "warmup_s": warmup_s,
        **wl.summarize_runs(
            times,
            len(prompts),
            sum(len(p) for p in prompts),
            sum(len(t) for t in token_ids),
        ),
        "versions": {
            "vllm": vllm.__version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": sys.version.split()[0],
        },
        "env": {
            k: os.environ[k]
            for k in sorted(os.environ)
            if k.startswith("VLLM_") or k in ("OMP_NUM_THREADS", "LD_PRELOAD")
        },
        "token_ids": token_ids,
    }
    wl.write_json(args.out, result)
    print(
        f"vllm: {result['output_tok_s']:.1f} output tok/s, {result['req_s']:.2f} req/s, "
        f"start-up {startup_s:.1f} s -> {args.out}"
    )
    return 0


def _load_workloads() -> ModuleType:
    """Import ``benchmarks/workloads.py`` by path (its folder is not on ``sys.path`` here)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("pagedllm_bench_workloads", _WORKLOADS_PY)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    sys.exit(main())
