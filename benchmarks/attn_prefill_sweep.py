"""Launch shapes of the prefill attention kernels on long prompts (Llama-3.1-8B's heads: 32
query heads over 8 KV heads, head_dim 128, bf16, block 16), one layer's call.

Benchmark D's prompts are 6,000 tokens; at that length attention is about a tenth of a
prompt's FLOPs and, at the kernels' ~280 TFLOPs (the H200 sweep in ``kernels.py`` at 4,096
tokens, against ~505 for PyTorch's flash SDPA on pre-gathered K/V), about a quarter of its
prefill time. This times the unified paged kernel (``paged_attention``, the uncompressed
engine's) and KV-Compress's per-head kernel (``kvc_paged_attention``) at each launch shape on
whole prompts and on a chunk after cached context, with SDPA (flash, K/V gathered and expanded
to every query head beforehand) as the reference, in TFLOPs (causal FLOPs: 4 x heads x
head_dim x keys seen). Each shape's output is checked against SDPA's.

Usage (GPU): python benchmarks/attn_prefill_sweep.py [--out DIR]
(``--smoke``: small chunks on the CPU through Triton's interpreter, to check the script.)
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.kernels import (  # noqa: E402
    BLOCK_SIZE,
    HEAD_DIM,
    NUM_KV_HEADS,
    Prefill,
    bench,
    write_gpu_result,
)
from pagedllm.ops.kvc_attention import kvc_paged_attention  # noqa: E402
from pagedllm.ops.paged_attention import TileConfig  # noqa: E402

CASES = [(1, 6000, 0), (8, 1024, 0), (1, 2048, 4096)]  # (prompts, chunk, cached context)
CONFIGS = [  # (block_m, tile_n, num_warps, num_stages); None: the kernels' defaults
    None,
    (64, 64, 4, 2),
    (64, 128, 4, 2),
    (64, 128, 4, 3),
    (64, 128, 8, 3),
    (128, 64, 4, 3),
    (128, 64, 8, 3),
    (128, 64, 8, 4),
    (128, 128, 8, 2),
    (128, 128, 8, 3),
    (256, 64, 8, 3),
]


def kvc_call(p: Prefill, cfg: TileConfig | None):
    """The same chunks through the per-head kernel: every KV head of a prompt reads the same
    blocks through its own table row (tables [B, H, W], lengths [B, H])."""
    b = p.batch
    kv = p.kv_cache  # [2, blocks, BS, H, D] -> per-head blocks [2, blocks * H, BS, D]
    nb = kv.shape[1]
    per_head = kv.permute(0, 1, 3, 2, 4).reshape(2, nb * NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    heads = torch.arange(NUM_KV_HEADS, device=kv.device, dtype=torch.int32)
    tables = (p.block_tables[:, None, :] * NUM_KV_HEADS + heads[None, :, None]).contiguous()
    lens = p.seq_lens[:, None].expand(b, NUM_KV_HEADS).contiguous()
    out = torch.empty_like(p.query)
    return lambda: kvc_paged_attention(
        p.query, per_head, p.qsl, lens, tables, p.q_len, p.scale, out=out, tile_config=cfg
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cpu" if args.smoke else "cuda")
    cases = [(1, 40, 0), (2, 16, 24)] if args.smoke else CASES
    configs = [None, (16, 16, 4, 2)] if args.smoke else CONFIGS
    rows = []
    for b, q, ctx in cases:
        p = Prefill(b, q, ctx, dev, seed=12)
        sdpa = p.sdpa()
        ref = sdpa().transpose(1, 2).reshape(p.query.shape).float()
        sdpa_ms = bench(sdpa, dev)
        print(f"{b} x {q} after {ctx}: sdpa {p.flops / sdpa_ms / 1e9:.0f} TFLOPs", flush=True)
        for shape in configs:
            cfg = None if shape is None else TileConfig(*shape)
            for kind, fn in (("paged", p.attention(cfg)), ("kvc", kvc_call(p, cfg))):
                try:
                    err = ((fn().float() - ref).norm() / ref.norm()).item()
                    ms = bench(fn, dev)
                except Exception as e:  # a shape that does not compile (shared memory)
                    print(f"  {kind} {shape}: {type(e).__name__}", flush=True)
                    continue
                row = {"prompts": b, "chunk": q, "ctx": ctx, "kernel": kind, "config": shape,
                       "ms": ms, "TFLOPs": p.flops / ms / 1e9, "sdpa_ms": sdpa_ms,
                       "sdpa_TFLOPs": p.flops / sdpa_ms / 1e9, "rel_err_vs_sdpa": err}  # fmt: skip
                rows.append(row)
                print(f"  {kind:5s} {str(shape):22s} {row['TFLOPs']:6.0f} TFLOPs  err {err:.1e}",
                      flush=True)  # fmt: skip
        del p
    if args.out:
        versions = {"triton": __import__("triton").__version__, "torch": torch.__version__}
        write_gpu_result(args.out, "attn_prefill_sweep", {**versions, "rows": rows})


if __name__ == "__main__":
    main()
