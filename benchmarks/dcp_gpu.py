"""Decode context parallelism (issue 56): the longest context and the time per output token
at ``decode_context_parallel_size`` 1 against 2 (or more), same ranks, same KV memory per rank.

DCP splits the tokens of a KV head that tensor parallelism copies onto several ranks, so it
applies where a model has fewer KV heads than ranks. The Llama-3.1-8B shape has 8 KV heads: at
tensor parallelism 2 each rank holds its own 4 and nothing is copied (vLLM's bound
dcp <= tp / num_kv_heads refuses DCP there). This benchmark therefore runs the 8B shape with
``--kv-heads`` KV heads (default 1, multi-query attention: every rank holds a copy of the one
KV head at DCP 1), random weights. Per DCP size the JSON holds the scheduler's KV pool in
tokens (the longest context that fits), the time to first token of one ``--prompt-len``-token
prompt and its time per output token over ``--output-len`` tokens (from two runs: 1 output
token and ``--output-len``; prefix caching off), and the ratios to DCP 1.

    python -P benchmarks/dcp_gpu.py --tp 2 --dcp 1,2 --out benchmarks/results   # 2 GPUs

writes ``dcp_<device>.json``. ``--model`` also takes a model folder and ``--device cpu`` runs
the same on CPU processes (gloo), for a check of the script itself.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.bench.throughput import device_name  # noqa: E402
from pagedllm.model.loader import resolve_model_path  # noqa: E402


def shape_folder(model: str, kv_heads: int, tmp: str) -> str:
    """A copy of the model's config folder with ``num_key_value_heads`` = ``kv_heads``."""
    src = Path(resolve_model_path(model, "dummy"))
    dst = Path(tmp) / "model"
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["num_key_value_heads"] = kv_heads
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


def run(args: argparse.Namespace, path: str, dcp: int, dummy: bool) -> dict:
    llm = LLM(path, load_format="dummy" if dummy else "auto", dtype=args.dtype, device=args.device,
              tensor_parallel_size=args.tp, decode_context_parallel_size=dcp,
              kv_cache_memory_bytes=int(args.kv_gib * 2**30), max_model_len=args.max_model_len,
              enable_prefix_caching=False, max_num_seqs=1,
              max_num_batched_tokens=args.chunk)  # fmt: skip
    kvm = llm.llm_engine.engine_core.scheduler.kv_cache_manager
    vocab = llm.llm_engine.config.model_config.hf_config.vocab_size
    prompt = [{"prompt_token_ids": [(7 * i) % (vocab - 3) + 3 for i in range(args.prompt_len)]}]
    times = {}
    for n in (1, args.output_len):
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm
        t = time.perf_counter()
        llm.generate(prompt, sp, use_tqdm=False)
        times[n] = time.perf_counter() - t
    llm.llm_engine.engine_core.shutdown()
    return {
        "decode_context_parallel_size": dcp,
        "kv_pool_tokens": kvm.num_blocks * kvm.block_size,
        "kv_blocks": kvm.num_blocks,
        "block_tokens": kvm.block_size,
        "ttft_s": times[1],
        "tpot_ms": (times[args.output_len] - times[1]) / (args.output_len - 1) * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b", help="built-in shape or a model folder")
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dcp", default="1,2")
    ap.add_argument("--prompt-len", type=int, default=126_000)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=131_072)
    ap.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens")
    ap.add_argument("--kv-gib", type=float, default=1.0, help="KV memory per rank")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dummy = not Path(args.model).is_dir()
    with tempfile.TemporaryDirectory() as tmp:
        path = shape_folder(args.model, args.kv_heads, tmp) if dummy else args.model
        rows = [run(args, path, int(d), dummy) for d in args.dcp.split(",")]
    base = rows[0]
    for row in rows:
        row["kv_pool_tokens_vs_first"] = row["kv_pool_tokens"] / base["kv_pool_tokens"]
        row["tpot_vs_first"] = row["tpot_ms"] / base["tpot_ms"]
        print(json.dumps(row))
    import torch

    device = device_name(torch.device(args.device))
    result = {"benchmark": "dcp", "device": device, "args": vars(args), "runs": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = device.replace(" ", "_")
    (out / f"dcp_{tag}.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
