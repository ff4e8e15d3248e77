"""Device time of one KV-Compress eviction step at Llama-3.1-8B's shape (32 layers x 8 KV
heads = 256 heads, head_dim 128, bf16, block 16), the cache of Benchmark D (4 GiB), and where
it goes by kernel.

Cases (cr 64: 128 KVs a head kept, protected window 32):
- ``prompt``: one 6,000-token prompt evicted after its prefill;
- ``prompt+copy``: the same after its cached prompt blocks are copied (prefix caching keeps
  them: ``HeadPagedKVCacheManager.detach_own``);
- ``room``: nine requests holding ~420 KVs a head (make-room evictions);
- ``mixed``: the prompt and the nine in one call (padded to 6,000 KVs a head), and
- ``mixed-groups``: the same in width groups (the runner's way).

Each case: median of ``--reps`` CUDA-event timings (the lengths restored between repeats), then
one run under torch.profiler (the top kernels). Usage (on a GPU):
  python benchmarks/kvc_compress_micro.py --out OUT
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch

from pagedllm.config import KVCompressConfig
from pagedllm.core.kv_cache.head_paged import HeadTable
from pagedllm.core.kv_cache.spec import HeadPagedSpec, cdiv
from pagedllm.kvcompress.cache import HeadPagedCache
from pagedllm.kvcompress.evict import move_bound, stuck_bound, width_groups

BS, LAYERS, HEADS, HEAD_DIM = 16, 32, 8, 128
LH = LAYERS * HEADS


def build(
    device: torch.device, cache_bytes: int, lens: list[int]
) -> tuple[HeadPagedCache, np.ndarray]:
    """A cache with one row per entry of ``lens`` (tokens held in every head), random block
    ids, random scores; returns it and the rows' lengths [R]."""
    spec = HeadPagedSpec(BS, HEADS, HEAD_DIM, 2, num_layers=LAYERS, compressible=(True,) * LAYERS)
    cfg = KVCompressConfig(enabled=True, max_cache_tokens=128)
    cache = HeadPagedCache(spec, cfg, torch.bfloat16, device, len(lens) + 1, 19000, [None] * LAYERS)
    num_blocks = cache_bytes // cache.block_bytes
    cache.allocate(num_blocks)
    need = sum(cdiv(n, BS) for n in lens) * LH
    assert need <= num_blocks, (need, num_blocks)
    ids = np.random.default_rng(0).permutation(num_blocks)[:need].astype(np.int32)
    at = 0
    for row, n in enumerate(lens):
        nb = cdiv(n, BS)
        table = ids[at : at + nb * LH].reshape(LH, nb)
        at += nb * LH
        cache.set_row(row, HeadTable(table, np.full(LH, n)), True)
    cache.flush_entries()
    g = torch.Generator(device=device).manual_seed(1)
    cache.scores.copy_(torch.rand(cache.scores.shape, generator=g, device=device))
    # positions: each head's logical index is its position (as after a prefill)
    for row, n in enumerate(lens):
        t = cache.tables[row, :, : cdiv(n, BS)].long()  # [LH, nb]
        slot = (t[..., None] * BS + torch.arange(BS, device=device)).reshape(LH, -1)[:, :n]
        cache.positions[slot.reshape(-1)] = torch.arange(
            n, device=device, dtype=torch.int32
        ).repeat(LH)
    cache.kv.normal_()
    return cache, np.asarray(lens)


def run_case(cache: HeadPagedCache, lens: np.ndarray, rows: list[list[int]], budget: int,
             copy_rows: set[int], tight: bool) -> None:  # fmt: skip
    """One eviction step: a compress call per group of ``rows``."""
    for group in rows:
        r = np.asarray(group, dtype=np.int64)
        held = lens[r] * LH
        budgets = np.full(len(r), budget * LH, dtype=np.int64)
        protect = lens[r] - 32
        keep = np.zeros(len(r), dtype=np.int64)
        max_len = int(lens[r].max())
        stuck = [stuck_bound(LH, int(n), int(p), 0, BS) if tight else None for n, p in
                 zip(lens[r], protect)]  # fmt: skip
        bounds = [move_bound(int(h), int(b), BS, "kvcompress", st)
                  for h, b, st in zip(held, budgets, stuck)]  # fmt: skip
        copies = []
        for row in group:
            if row in copy_rows:
                nb = cdiv(int(lens[row]), BS)
                src = cache.tables[row, :, :nb].reshape(-1).long().cpu().numpy()
                copies.append((row, src))
        if copies:  # copy the blocks onto themselves' neighbours: ids past the rows' own
            src = np.concatenate([s for _, s in copies])
            dst = (src + 1) % cache.num_blocks
            s_t, d_t = cache.ship(src, dst)
            cache._copy_ids(s_t, d_t)
        cache.compress(r, budgets, protect, keep, max_len, max(sum(bounds), 1))


def time_case(cache, lens, rows, budget, copy_rows, tight, reps):
    saved = cache.lens.clone()
    cuda = cache.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times = []
    for i in range(reps + 1):
        cache.lens.copy_(saved)
        sync()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        run_case(cache, lens, rows, budget, copy_rows, tight)
        if cuda:
            end.record()
        sync()
        if i:
            times.append(start.elapsed_time(end) if cuda else 1e3 * (time.perf_counter() - t0))
    cache.lens.copy_(saved)
    from torch.profiler import ProfilerActivity, profile

    act = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
    with profile(activities=[act]) as prof:
        run_case(cache, lens, rows, budget, copy_rows, tight)
        sync()
    cache.lens.copy_(saved)
    top = []
    total = (lambda e: e.device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    for ev in sorted(prof.key_averages(), key=lambda e: -total(e))[:12]:
        top.append({"name": ev.key[:90], "calls": ev.count, "ms": total(ev) / 1e3})
    return statistics.median(times), top


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cache-bytes", type=int, default=4 << 30)
    ap.add_argument("--prompt-len", type=int, default=6000)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    dev = torch.device(args.device)
    lens = [args.prompt_len] + [int(x) for x in np.random.default_rng(2).integers(380, 460, size=9)]
    cache, lens_np = build(dev, args.cache_bytes, lens)
    room = list(range(1, 10))
    cases = {
        "prompt": ([[0]], set()),
        "prompt+copy": ([[0]], {0}),
        "room": ([room], set()),
        "mixed": ([[0] + room], set()),
        "mixed-groups": (width_groups(lens), set()),  # (row i holds lens[i])
    }
    device = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    res = {"device": device, "torch": torch.__version__,
           "git_commit": os.environ.get("PAGEDLLM_COMMIT"), "lens": lens, "cases": {}}  # fmt: skip
    for name, (rows, copy_rows) in cases.items():
        for tight in (False, True):
            ms, top = time_case(cache, lens_np, rows, 128, copy_rows, tight, args.reps)
            key = name + ("/tight-moves" if tight else "")
            res["cases"][key] = {"ms": ms, "top_kernels": top}
            print(f"{key:28s} {ms:8.3f} ms   top: " + ", ".join(
                f"{t['name'][:40]} {t['ms']:.2f}" for t in top[:4]), flush=True)  # fmt: skip
    name = res["device"].replace(" ", "_")
    path = os.path.join(args.out, f"kvc_compress_micro_{name}.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print("wrote", path, time.strftime("%T"))


if __name__ == "__main__":
    main()
