"""What ngram_gpu's device work costs a step (issue 19): the host time to queue
``DeviceDrafts``' correction, draft inputs and verification (with the lookup) for a decode
step of B rows verifying k drafts, and the device time they take, at B = 1, 16, 64, 256.

``--torch``: the PyTorch path (the CPU's) instead of the Triton kernels, on the GPU.
The host time is what an asynchronous step adds to the engine loop (at batch 1 the loop and
the device take ~1.5 ms each); the device time is what the step adds on the GPU.

    python benchmarks/ngram_gpu_micro.py --out $OUT
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedllm.attention.metadata import AttentionMetadata  # noqa: E402
from pagedllm.worker.device_drafts import DeviceDrafts  # noqa: E402


def one_case(batch: int, k: int, ctx: int, iters: int, use_torch: bool) -> dict:
    dev = torch.device("cuda")
    dd = DeviceDrafts(batch, 1024, k, 3, 3, dev)
    dd.use_triton = not use_torch
    rng = np.random.default_rng(0)
    for r in range(batch):
        dd.add_rows([r], [rng.integers(0, 50, ctx)])
    rows = np.arange(batch)
    n_sched = np.full(batch, 1 + k)
    total = int(n_sched.sum())
    bs, nb = 16, (ctx + 2 * k + 16) // 16 + 1
    bt = torch.arange(batch * nb, dtype=torch.int32, device=dev).view(batch, nb)
    pos_host = np.repeat(np.full(batch, ctx), n_sched) + np.tile(np.arange(1 + k), batch)
    samples = torch.randint(0, 50, (total,), device=dev)
    first = np.arange(batch) * (1 + k)
    ks = np.full(batch, k)
    unv = np.full(batch, k)  # every row's last step unresolved: the correction runs
    qsl = torch.arange(0, total + 1, 1 + k, dtype=torch.int32, device=dev)

    def step() -> None:
        positions = torch.from_numpy(pos_host.astype(np.int32)).to(dev, non_blocking=True)
        md = AttentionMetadata(
            num_reqs=batch,
            num_actual_tokens=total,
            query_start_loc=qsl,
            seq_lens=torch.full((batch,), ctx + 1 + k, dtype=torch.int32, device=dev),
            slot_mapping=torch.zeros(total, dtype=torch.int64, device=dev),
            block_tables=bt,
            max_query_len=1 + k,
            max_seq_len=ctx + 1 + k,
            block_size=bs,
        )
        input_ids = torch.zeros(total, dtype=torch.int32, device=dev)
        t0 = time.perf_counter()
        used, valid = dd.prepare(input_ids, positions, md, n_sched, rows, unv, ks)
        t1 = time.perf_counter()
        dd.verify(samples, rows, first, ks, rows, md.seq_lens, used, valid, ctx + k + 2)
        t2 = time.perf_counter()
        host[0] += t1 - t0
        host[1] += t2 - t1

    host = [0.0, 0.0]
    for _ in range(20):
        step()
    torch.cuda.synchronize()
    host = [0.0, 0.0]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        step()
    end.record()
    end.synchronize()
    return {
        "path": "torch" if use_torch else "triton",
        "batch": batch,
        "k": k,
        "context": ctx,
        "host_ms_prepare": 1e3 * host[0] / iters,
        "host_ms_verify": 1e3 * host[1] / iters,
        "wall_ms_per_step": start.elapsed_time(end) / iters,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--torch", action="store_true", help="also time the PyTorch path")
    a = ap.parse_args()
    paths = [False, True] if a.torch else [False]
    rows = [one_case(b, 4, 320, a.iters, t) for t in paths for b in (1, 16, 64, 256)]
    for r in rows:
        print(json.dumps(r), flush=True)
    os.makedirs(a.out, exist_ok=True)
    name = torch.cuda.get_device_name().replace(" ", "_")
    commit = os.environ.get("PAGEDLLM_COMMIT")
    with open(os.path.join(a.out, f"ngram_gpu_micro_{name}.json"), "w") as f:
        json.dump({"benchmark": "ngram_gpu_micro", "git_commit": commit, "rows": rows}, f)


if __name__ == "__main__":
    main()
