"""KV-Compress's per-head decode kernel on uneven heads: does a layer's step cost its total
keys, or its longest head?

After an eviction to a budget, a request's heads keep very different numbers of KVs (the
cheapest chunks go first, across every head). The single-pass kernel runs one program per
(row, KV head), so a few long heads could set a layer's time. This times one layer's decode
(Llama-3.1-8B shape: 32 query heads over 8 KV heads, head_dim 128, bf16, block 16, the score
pass on as for requests with budgets) on 128 rows whose heads hold the same mean number of
keys, uniform or skewed, single pass (the engine's choice at this batch by default)
and split "S:M" (S splits of at least M key tiles each: ``min_split_tiles``; "lS:M:T" with
``long_tiles`` T: the single pass for heads of at most T tiles, only the longer ones split; "wS:M"
at be8bab7 was a persistent grid over a list of every head's splits with work), as a fraction of
the device's copy bandwidth (bytes of K/V read / time); each against the single pass's output
and scores (max abs difference). A config may name its launch shape after "@" (key tile,
warps, pipelining stages; default the engine's): "1:1@128:4:3", "l8:8:16@64:8:3".
``tail-P``: Benchmark D's heads after its evictions (100 - P percent lognormal around the
mean, P percent holding a whole 6,000-token prompt, as the bench's device-length samples show
at 6,000 / cr 8: p50 880, p99 4,225, max 6,452).

Usage (GPU): python benchmarks/kvc_decode_skew.py [--out DIR]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.kernels import bench, copy_bandwidth_gbps  # noqa: E402
from pagedllm.ops.kvc_attention import kvc_decode_attention  # noqa: E402
from pagedllm.ops.paged_attention import TileConfig  # noqa: E402

BS, HEAD_DIM, HEADS, KV_HEADS = 16, 128, 32, 8


def head_lens(kind: str, rows: int, mean: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, KV_HEADS] lengths with the given mean. ``uniform``: every head ``mean``;
    ``lognormal-S``: lognormal with sigma S, scaled to the mean, at most 6,000; ``one-long``:
    one head of each row 16x the others."""
    if kind == "uniform":
        return np.full((rows, KV_HEADS), mean)
    if kind.startswith("lognormal"):
        sigma = float(kind.split("-")[1])
        x = rng.lognormal(0.0, sigma, size=(rows, KV_HEADS))
        x = np.minimum(x * mean / x.mean(), 6000)
        return np.maximum(np.round(x * mean / x.mean()), 1).astype(np.int64)
    if kind.startswith("tail"):
        share = float(kind.split("-")[1]) / 100
        x = rng.lognormal(0.0, 0.3, size=(rows, KV_HEADS))
        x = x * mean / x.mean()
        tail = rng.random((rows, KV_HEADS)) < share
        x[tail] = rng.integers(6000, 6450, size=int(tail.sum()))
        return np.maximum(np.round(x), 1).astype(np.int64)
    if kind == "one-long":
        x = np.full((rows, KV_HEADS), 1.0)
        x[np.arange(rows), rng.integers(0, KV_HEADS, rows)] = 16.0
        return np.maximum(np.round(x * mean / x.mean()), 1).astype(np.int64)
    raise ValueError(kind)


def make(lens: np.ndarray, seed: int, dev: torch.device) -> dict:
    g = torch.Generator(device=dev).manual_seed(seed)
    rows = lens.shape[0]
    nblk = -(-lens // BS)  # [rows, KV_HEADS]
    total, width = int(nblk.sum()), int(nblk.max())
    cache = torch.randn((2, total, BS, HEAD_DIM), generator=g, device=dev, dtype=torch.bfloat16)
    perm = torch.randperm(total, generator=g, device=dev).to(torch.int32)
    tables = torch.zeros((rows, KV_HEADS, width), dtype=torch.int32, device=dev)
    at = 0
    for r in range(rows):
        for h in range(KV_HEADS):
            n = int(nblk[r, h])
            tables[r, h, :n] = perm[at : at + n]
            at += n
    return {
        "query": torch.randn(rows, HEADS, HEAD_DIM, generator=g, device=dev).to(torch.bfloat16),
        "cache": cache,
        "tables": tables,
        "seq_lens": torch.from_numpy(lens).to(dev),
        "scores": torch.zeros(total * BS, device=dev),
        "scored": torch.ones(rows, dtype=torch.int32, device=dev),
        "kv_bytes": int(lens.sum()) * HEAD_DIM * 2 * 2,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--cases", default="128x400,128x1500",
                    help="ROWSxMEAN,...: rows of the batch and the heads' mean length")
    ap.add_argument("--kinds", default="uniform,lognormal-1.0,lognormal-1.5,one-long")
    ap.add_argument("--configs", default="1:1,4:1,8:1,4:8,8:4,8:8,8:16,16:8",
                    help="S:M splits (1:1 the single pass), lS:M:T only heads past T tiles")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    dev = torch.device(args.device)
    bw = copy_bandwidth_gbps(dev, 1 << 30 if dev.type == "cuda" else 1 << 24)
    rng = np.random.default_rng(0)
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    res = {"device": name, "git_commit": os.environ.get("PAGEDLLM_COMMIT"),
           "copy_bandwidth_GBps": bw, "cases": []}  # fmt: skip
    for case in args.cases.split(","):
        rows, mean = (int(x) for x in case.split("x"))
        for kind in args.kinds.split(","):
            lens = head_lens(kind, rows, mean, rng)
            b = make(lens, 1, dev)
            out = torch.empty_like(b["query"])
            row = {"rows": rows, "mean": mean, "kind": kind, "max_len": int(lens.max()),
                   "mean_len": float(lens.mean()), "p99_len": float(np.percentile(lens, 99)),
                   "splits": {}}  # fmt: skip
            # (S:M without "l": every head's S programs, its short heads' later ones empty;
            # until 3416e49 a head that fitted in split 0 was finished there when M > 1)
            base = None
            for key in args.configs.split(","):
                split_key, _, shape = key.partition("@")
                tile_config = None
                if shape:  # TILE:WARPS:STAGES for the single pass and the split kernels alike
                    tn, nw, ns = (int(x) for x in shape.split(":"))
                    tile_config = TileConfig(block_m=16, tile_n=tn, num_warps=nw, num_stages=ns,
                                             split_num_stages=ns)  # fmt: skip
                nums = [int(x) for x in split_key.lstrip("l").split(":")]
                splits, min_tiles = nums[:2]
                long_tiles = (nums[2] if len(nums) > 2 else min_tiles) if key[0] == "l" else 0
                fn = functools.partial(
                    kvc_decode_attention, b["query"], b["cache"], b["tables"], b["seq_lens"],
                    HEAD_DIM**-0.5, scores=b["scores"], scored=b["scored"], num_splits=splits,
                    out=out, min_split_tiles=min_tiles, long_tiles=long_tiles,
                    tile_config=tile_config,
                )  # fmt: skip
                # correctness against the single pass: output and one call's scores
                b["scores"].zero_()
                got = fn().float()
                sc = b["scores"].clone()
                if base is None:
                    base = (got, sc)
                err = max(float((got - base[0]).abs().max()), float((sc - base[1]).abs().max()))
                ms = bench(fn, dev)
                frac = b["kv_bytes"] / (ms * 1e-3) / (bw * 1e9)
                row["splits"][key] = {"us": ms * 1e3, "bandwidth_fraction": frac, "max_err": err}
            res["cases"].append(row)
            print(f"{rows:3d} x {mean:5d} {kind:14s} max {row['max_len']:5d} " + "  ".join(
                f"{k}: {v['us']:6.1f}" for k, v in row["splits"].items())
                + f"  max err {max(v['max_err'] for v in row['splits'].values()):.1e}",
                flush=True)  # fmt: skip
    tag = f"_{res['git_commit']}" if res["git_commit"] else ""
    path = os.path.join(args.out, f"kvc_decode_skew_{res['device'].replace(' ', '_')}{tag}.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
