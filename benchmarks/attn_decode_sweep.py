"""Decode attention launch shapes on the batches Benchmark A and B actually run.

Benchmark A decodes 256 requests with ragged contexts (100-2048) on the Qwen3-0.6B shape (16
query heads over 8 KV heads, GQA 2); Benchmark B 256 requests on the Llama-3.1-8B shape (32
over 8, GQA 4). The default launch shape was picked on uniform-length GQA-4 batches
(benchmarks/attn_kernels.py), so this times every (tile_n, num_warps, num_stages) of the unified
kernel and split counts 2/4 on ragged and uniform batches of both shapes, as a fraction of the
device copy bandwidth measured in the same run (bytes of K/V read / time). Layout "kvc" times
KV-Compress's per-head decode kernel (:func:`pagedllm.ops.kvc_attention.kvc_decode_attention`)
on the same lengths, every head of a request as long as the request (a budget that never
evicts: Benchmark A's overhead run), over the same launch shapes; layout "kvcs" the same kernel
built with its score pass (no row scored), as a step that has a budgeted request runs it.

Usage (GPU): python benchmarks/attn_decode_sweep.py [--layouts nhd,kvcs] [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.attn_kernels import bench, copy_bandwidth_gbps  # noqa: E402
from pagedllm.ops.kvc_attention import kvc_decode_attention  # noqa: E402
from pagedllm.ops.paged_attention import TileConfig, paged_attention  # noqa: E402

BLOCK_SIZE, HEAD_DIM = 16, 128


def make_batch(lens: list[int], heads: int, kv_heads: int, seed: int, layout: str) -> dict:
    """A decode batch: request r has lens[r] cached tokens (its last is the new one), blocks
    scattered at random over a cache just big enough. ``layout`` "nhd": the engine's cache,
    [2, blocks, block_size, kv_heads, head_dim]; "hnd": [2, blocks, kv_heads, block_size,
    head_dim] memory (a block's keys of one head contiguous: 4 KB reads instead of 256 B),
    passed to the kernel as the same-shaped strided view; "kvc": KV-Compress's cache
    [2, blocks * kv_heads, block_size, head_dim] with a table [requests, kv_heads, width] and
    lengths [requests, kv_heads] per head."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    nblk = [-(-n // BLOCK_SIZE) for n in lens]
    total, width = sum(nblk), max(nblk)
    kvc = layout in ("kvc", "kvcs")
    if kvc:
        cache = torch.randn(
            (2, total * kv_heads, BLOCK_SIZE, HEAD_DIM), generator=g, device=dev,
            dtype=torch.bfloat16,
        )  # fmt: skip
    elif layout == "hnd":
        cache = torch.randn(
            (2, total, kv_heads, BLOCK_SIZE, HEAD_DIM), generator=g, device=dev,
            dtype=torch.bfloat16,
        ).transpose(2, 3)  # fmt: skip
    else:
        cache = torch.randn(
            (2, total, BLOCK_SIZE, kv_heads, HEAD_DIM), generator=g, device=dev,
            dtype=torch.bfloat16,
        )  # fmt: skip
    b = len(lens)
    if kvc:
        perm = torch.randperm(total * kv_heads, generator=g, device=dev).to(torch.int32)
        tables = torch.zeros((b, kv_heads, width), dtype=torch.int32, device=dev)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)[:, None]
        seq_lens = seq_lens.expand(b, kv_heads).contiguous()
    else:
        perm = torch.randperm(total, generator=g, device=dev).to(torch.int32)
        tables = torch.zeros((b, width), dtype=torch.int32, device=dev)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    at = 0
    for r, n in enumerate(nblk):
        if kvc:
            tables[r, :, :n] = perm[at : at + n * kv_heads].view(kv_heads, n)
            at += n * kv_heads
        else:
            tables[r, :n] = perm[at : at + n]
            at += n
    return {
        "query": torch.randn(b, heads, HEAD_DIM, generator=g, device=dev).to(torch.bfloat16),
        "cache": cache,
        "qsl": torch.arange(b + 1, dtype=torch.int32, device=dev),
        "seq_lens": seq_lens,
        "kvc": kvc,
        # "kvcs": the engine's never-evicting requests: the kernel built with the score pass,
        # every row's ``scored`` flag 0
        "scores": torch.zeros(total * kv_heads * BLOCK_SIZE, device=dev)
        if layout == "kvcs"
        else None,
        "scored": torch.zeros(b, dtype=torch.int32, device=dev) if layout == "kvcs" else None,
        "tables": tables,
        "max_len": max(lens),
        "kv_bytes": sum(lens) * kv_heads * HEAD_DIM * 2 * 2,
    }


def time_one(batch: dict, splits: int, cfg: TileConfig | None) -> float:
    out = torch.empty_like(batch["query"])
    if batch["kvc"]:
        return bench(
            lambda: kvc_decode_attention(
                batch["query"],
                batch["cache"],
                batch["tables"],
                batch["seq_lens"],
                HEAD_DIM**-0.5,
                scores=batch["scores"],
                scored=batch["scored"],
                num_splits=splits,
                tile_config=cfg,
                out=out,
            ),  # fmt: skip
            torch.device("cuda"),
        )
    return bench(
        lambda: paged_attention(
            batch["query"],
            batch["cache"],
            batch["qsl"],
            batch["seq_lens"],
            batch["tables"],
            1,
            batch["max_len"],
            HEAD_DIM**-0.5,
            None,
            out=out,
            num_splits=splits,
            tile_config=cfg,
        ),  # fmt: skip
        torch.device("cuda"),
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results", help="folder of the result file")
    ap.add_argument("--layouts", default="nhd", help="comma list of nhd, hnd, kvc, kvcs")
    ap.add_argument("--cases", default="", help="comma list of case names (default: all)")
    ap.add_argument("--narrow", action="store_true", help="tiles 64/128, no split")
    ap.add_argument("--quick", action="store_true", help="two launch shapes, no split")
    args = ap.parse_args()
    bw = copy_bandwidth_gbps(torch.device("cuda"), 1 << 30)
    rng = np.random.default_rng(0)
    cases = {
        "qwen3_ragged_100_2048": (16, 8, rng.integers(100, 2049, 256).tolist()),
        "qwen3_uniform_1024": (16, 8, [1024] * 256),
        "qwen3_uniform_512": (16, 8, [512] * 256),
        "llama8b_ragged_128_1152": (32, 8, rng.integers(128, 1153, 256).tolist()),
    }
    if args.cases:
        cases = {k: v for k, v in cases.items() if k in args.cases.split(",")}
    configs = [(1, TileConfig(16, tn, w, st)) for tn, w, st in
               itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4))]  # fmt: skip
    configs += [(s, TileConfig(16, 64, 4, 2, sst)) for s in (2, 4) for sst in (2, 3, 4)]
    if args.narrow:  # the shapes that won somewhere, for a second look
        configs = [(1, TileConfig(16, tn, w, st)) for tn, w, st in
                   itertools.product((64, 128), (2, 4, 8), (2, 3))]  # fmt: skip
    if args.quick:
        configs = [(1, TileConfig(16, 64, 4, 2)), (1, TileConfig(16, 128, 4, 3))]
    result: dict = {"device": torch.cuda.get_device_name(0), "copy_bandwidth_GBps": bw}
    for (case, (heads, kv_heads, lens)), layout in itertools.product(
        cases.items(), args.layouts.split(",")
    ):
        name = f"{case}_{layout}"
        batch = make_batch(lens, heads, kv_heads, seed=1, layout=layout)
        rows = []
        default_ms = time_one(batch, 1, None)
        for splits, cfg in configs:
            try:
                ms = time_one(batch, splits, cfg)
            except Exception as e:  # a shape that does not fit (shared memory): skip it
                rows.append({"splits": splits, "cfg": str(cfg), "error": repr(e)[:120]})
                continue
            rows.append({"splits": splits, "tile_n": cfg.tile_n, "warps": cfg.num_warps,
                         "stages": cfg.num_stages, "split_stages": cfg.split_num_stages,
                         "ms": ms, "frac": batch["kv_bytes"] / (ms * 1e-3) / 1e9 / bw})  # fmt: skip
        ok = sorted((r for r in rows if "ms" in r), key=lambda r: r["ms"])
        result[name] = {
            "default_ms": default_ms,
            "default_frac": batch["kv_bytes"] / (default_ms * 1e-3) / 1e9 / bw,
            "best": ok[:6],
            "all": rows,
        }
        print(name, "default", round(result[name]["default_frac"], 3), flush=True)
        for r in ok[:6]:
            print("   ", {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()})
        del batch
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"attn_decode_sweep_{result['device'].replace(' ', '_')}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
