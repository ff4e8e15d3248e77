"""Prefill attention on the CPU: the compiled kernel (``paged_prefill``) against the
SDPA path it replaces (torch's flash-attention CPU kernel a chunk, keys gathered from the
cache where the chunk has context), both through the attention backend's ``forward`` on one
step's shape: ``--prompts`` first chunks of ``--tokens`` (SmolLM2-135M's heads by default: 9
query heads, 3 KV heads, head size 64, blocks of 16), and a second run of chunks after as many
cached keys; bfloat16 or float32. Rounds alternate kernel / SDPA (this machine's speed
drifts); outputs compared.

    .venv/bin/python benchmarks/cpu_prefill_attention.py [--dtype float32] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.throughput import device_info  # noqa: E402
from pagedllm.attention.backends import torch_native  # noqa: E402
from pagedllm.attention.metadata import AttentionMetadata  # noqa: E402


def _step(prompts: int, tokens: int, ctx: int, H: int, KVH: int, D: int, bs: int, dtype):  # noqa: ANN001, ANN202
    g = torch.Generator().manual_seed(0)
    seq = ctx + tokens
    per = (seq + bs - 1) // bs
    num_blocks = prompts * per + 1
    tables = torch.randperm(num_blocks, generator=g)[: prompts * per].view(prompts, per)
    tables = tables.numpy().astype(np.int32)
    kv = torch.randn(2, num_blocks, bs, KVH, D, generator=g).to(dtype)
    T = prompts * tokens
    qkv = torch.randn(T, H + 2 * KVH, D, generator=g).to(dtype)
    q, k, v = qkv[:, :H], qkv[:, H : H + KVH], qkv[:, H + KVH :]
    pos = np.tile(np.arange(ctx, seq), prompts)
    req = np.repeat(np.arange(prompts), tokens)
    slots = torch.from_numpy(tables[req, pos // bs].astype(np.int64) * bs + pos % bs)
    qsl = np.arange(prompts + 1) * tokens
    lens = np.full(prompts, seq, dtype=np.int64)

    def md() -> AttentionMetadata:
        m = AttentionMetadata(
            num_reqs=prompts, num_actual_tokens=T, query_start_loc=torch.from_numpy(qsl),
            seq_lens=torch.from_numpy(lens), slot_mapping=slots,
            block_tables=torch.from_numpy(tables), max_query_len=tokens, max_seq_len=seq,
            block_size=bs, query_start_loc_np=qsl, seq_lens_np=lens,
        )  # fmt: skip
        m.plan["block_tables_np"] = tables
        return m

    return q, k, v, kv, md


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=8, help="chunks a step (2,048 tokens)")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=30, help="forward calls a round (layers)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    ext = torch_native._decode_kernel(dtype)
    assert ext is not None, "the CPU kernels are not built"
    H, KVH, D, bs = args.heads, args.kv_heads, args.head_dim, 16
    backend = torch_native.TorchNativeBackend()
    result: dict = {
        "benchmark": "cpu prefill attention: compiled kernel vs SDPA (backend forward)",
        "device": device_info(), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "amx": bool(ext.amx_decode()), "args": vars(args), "cases": [],
    }  # fmt: skip
    for ctx in (0, args.tokens):
        q, k, v, kv, md = _step(args.prompts, args.tokens, ctx, H, KVH, D, bs, dtype)
        paths = {"kernel": lambda dtype=None: ext, "sdpa": lambda dtype=None: None}
        outs, times = {}, {name: [] for name in paths}
        for _ in range(args.rounds):
            for name, pick in paths.items():
                torch_native._decode_kernel = pick  # type: ignore[assignment]
                m = md()  # one step's plan, shared by its layers as in the engine
                outs[name] = backend.forward(q, k, v, kv, m, D**-0.5, None)
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    backend.forward(q, k, v, kv, m, D**-0.5, None)
                times[name].append((time.perf_counter() - t0) / args.calls * 1e3)
        err = (outs["kernel"].float() - outs["sdpa"].float()).abs().max().item()
        best = {name: min(ts) for name, ts in times.items()}
        case = {
            "context": ctx, "tokens": args.prompts * args.tokens,
            "ms_per_call_best": best, "ms_per_call_all": times,
            "speedup_kernel_over_sdpa": best["sdpa"] / best["kernel"], "max_abs_diff": err,
        }  # fmt: skip
        result["cases"].append(case)
        ratio = case["speedup_kernel_over_sdpa"]
        print(f"context {ctx}: kernel {best['kernel']:.3f} ms, SDPA {best['sdpa']:.3f} ms a "
              f"call -> {ratio:.2f}x (max |diff| {err:.2e})")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
