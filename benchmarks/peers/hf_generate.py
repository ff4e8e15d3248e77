"""HF transformers static-batching peer for the throughput benchmark.

Run with the project venv's interpreter, e.g.::

    .venv/bin/python benchmarks/peers/hf_generate.py --model DIR
        --num-prompts 64 --input-len 128 --output-len 64 --out /tmp/hf.json

All prompts go into one left-padded batch for ``model.generate(do_sample=False,
max_new_tokens=N, min_new_tokens=N)`` (so EOS never ends a row early), with 2 torch threads.
One warm-up then ``--repeats`` timed runs; the JSON has the same fields as the vLLM peer's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

_WORKLOADS_PY = Path(__file__).resolve().parent.parent / "workloads.py"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line arguments (same as the vLLM peer's, plus ``--threads``)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="HF model folder")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=0.0)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--out", required=True, help="where to write the result JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the workload with ``model.generate`` and write the result JSON."""
    args = parse_args(argv)
    wl: Any = _load_workloads()
    prompts = wl.random_prompts(
        args.num_prompts,
        args.input_len,
        wl.model_vocab_size(args.model),
        args.seed,
        args.range_ratio,
    )

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval()
    startup_s = time.perf_counter() - t0

    cfg = model.config
    eos = cfg.eos_token_id
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else eos
    if isinstance(pad, list):
        pad = pad[0]
    if pad is None:
        pad = 0
    gen_config = GenerationConfig(
        do_sample=False,
        max_new_tokens=args.output_len,
        min_new_tokens=args.output_len,
        pad_token_id=pad,
        eos_token_id=eos,
        bos_token_id=cfg.bos_token_id,
    )

    # One batch, left padding (a no-op when all prompts have the same length).
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), int(pad), dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, ids in enumerate(prompts):
        input_ids[i, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        attention_mask[i, width - len(ids) :] = 1

    def run_once() -> tuple[float, list[list[int]]]:
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids, attention_mask=attention_mask, generation_config=gen_config
            )
        elapsed = time.perf_counter() - start
        return elapsed, out[:, width:].tolist()

    warmup_s, token_ids = run_once()
    times: list[float] = []
    for _ in range(args.repeats):
        elapsed, ids = run_once()
        times.append(elapsed)
        if ids != token_ids:
            print("warning: HF greedy output changed between runs", file=sys.stderr)
        token_ids = ids
    short = [i for i, t in enumerate(token_ids) if len(t) != args.output_len]
    if short:
        print(f"warning: {len(short)} rows not of length {args.output_len}", file=sys.stderr)

    result = {
        "engine": "hf",
        "model": str(args.model),
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "range_ratio": args.range_ratio,
        "dtype": args.dtype,
        "seed": args.seed,
        "repeats": args.repeats,
        "threads": args.threads,
        "startup_s": startup_s,
        "warmup_s": warmup_s,
        **wl.summarize_runs(
            times,
            len(prompts),
            sum(len(p) for p in prompts),
            sum(len(t) for t in token_ids),
        ),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": sys.version.split()[0],
        },
        "env": {
            k: os.environ[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS") if k in os.environ
        },
        "token_ids": token_ids,
    }
    wl.write_json(args.out, result)
    print(
        f"hf: {result['output_tok_s']:.1f} output tok/s, {result['req_s']:.2f} req/s, "
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
