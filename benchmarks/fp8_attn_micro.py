"""Paged decode attention over a bf16 cache against an fp8 one (issue 56), kernel alone, on
one GPU: Llama-3.1-8B's heads (32 query heads over 8 KV heads, head_dim 128), block 16,
decode batches of ``--batches`` at ``--ctx`` tokens each; per cache dtype and key tile
(``--tiles``) the microseconds a call and the KV bytes read per second against the device's
copy bandwidth. What the engine's default tile is for an fp8 cache comes from here.
``--configs`` sweeps launch shapes as TILE_N:WARPS:STAGES (the tiles of ``--tiles`` run with
the defaults' 4 warps and 2 stages, the split-K path's stages as its default).

    python -P benchmarks/fp8_attn_micro.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))

from benchmarks.attn_kernels import bench  # noqa: E402
from benchmarks.gpu_suite import device_tag, provenance  # noqa: E402
from pagedllm.bench.roofline import measure_copy_bandwidth  # noqa: E402
from pagedllm.kv_layout import FP8  # noqa: E402
from pagedllm.ops.paged_attention import (  # noqa: E402
    TileConfig,
    choose_num_splits,
    paged_attention,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batches", default="32,128,256")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--tiles", default="64,128")
    ap.add_argument("--configs", default="",
                    help="extra launch shapes, TILE_N:WARPS:STAGES comma-separated (default none)")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    dev = torch.device("cuda")
    heads, kvh, d, bs = 32, 8, 128, 16
    bw = measure_copy_bandwidth(dev)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        nblk = args.ctx // bs
        num_blocks = batch * nblk + 1
        perm = torch.randperm(num_blocks - 1, device=dev)[: batch * nblk] + 1
        tables = perm.view(batch, nblk).to(torch.int32)
        q = torch.randn(batch, heads, d, device=dev, dtype=torch.bfloat16)
        qsl = torch.arange(batch + 1, device=dev, dtype=torch.int32)
        lens = torch.full((batch,), args.ctx, device=dev, dtype=torch.int32)
        base = torch.randn(2, num_blocks, bs, kvh, d, device=dev, dtype=torch.bfloat16)
        scale = torch.full((2, kvh), 0.05, device=dev)
        caches = {"bf16": (base, None), "fp8": ((base / 0.05).to(FP8), scale)}
        splits = choose_num_splits(batch, kvh, 1, args.ctx, dev)
        for name, (cache, kv_scale) in caches.items():
            kv_bytes = batch * args.ctx * kvh * d * 2 * cache.element_size()
            shapes = [(int(t), 4, 2) for t in args.tiles.split(",")]
            shapes += [tuple(int(x) for x in c.split(":")) for c in args.configs.split(",") if c]
            for tile, warps, stages in shapes:
                # the split-K path (32 requests) keeps its own default depth at the defaults
                default = (warps, stages) == (4, 2)
                cfg = TileConfig(block_m=16, tile_n=tile, num_warps=warps, num_stages=stages,
                                 split_num_stages=TileConfig(16, tile).split_num_stages
                                 if default else stages)  # fmt: skip

                inputs = (q, cache, qsl, lens, tables, 1, args.ctx, d**-0.5)
                # CUDA-graph replays, L2 flushed between runs (benchmarks/attn_kernels.py)
                s = 1e-3 * bench(lambda x=inputs, c=cfg, k=kv_scale: paged_attention(
                    *x, tile_config=c, kv_scale=k), dev)  # fmt: skip
                rows.append({"batch": batch, "ctx": args.ctx, "cache": name, "tile_n": tile,
                             "num_warps": warps, "num_stages": stages,
                             "num_splits": splits, "us": s * 1e6,
                             "kv_GBps": kv_bytes / s / 1e9,
                             "fraction_of_copy_bw": kv_bytes / s / bw})  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
    out = {**provenance("fp8-attn-micro"), "copy_bandwidth_GBps": bw / 1e9, "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"fp8_attn_micro_{device_tag()}.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
