"""Paged-attention microbenchmark: the Triton kernels against PyTorch baselines.

Decode (the main table): decode-only batches (one query token per request) of ``batch``
requests, each with ``context`` cached tokens, head_dim 128, 32 query heads over 8 KV heads
(GQA 4), block size 16, bf16, blocks scattered randomly over the cache. For batch 1/32/256 x
context 512/4096/32k:

- ``triton_auto``: :func:`paged_attention` as the backend calls it (the dispatcher picks the
  path); ``triton_auto_eager`` is the same without a CUDA graph (Python launch cost included);
- ``triton_unified`` and ``split_<n>``: each path forced (``triton_split`` = best split count);
- ``triton_backend``: :class:`TritonBackend` ``forward`` (KV write + attention);
- ``sdpa_pregathered``: ``F.scaled_dot_product_attention`` on K/V already gathered into
  contiguous [B, KVH, L, D] tensors (the GQA group folded into the query length, so the flash
  kernel runs with no mask and no K/V expansion): a lower bound for any gather + SDPA;
- ``gather_sdpa``: the block gather plus that SDPA;
- ``torch_native_backend``: the CPU backend's ``forward`` on the GPU (eager: its KV write syncs
  with the host); its host-side plan is built once, outside the timing.

Every variant except the ``_eager`` ones is captured in a CUDA graph and its replays are timed
(``triton.testing.do_bench``, median, L2 flushed between replays), as the engine runs decode.
Achieved bandwidth = bytes of K/V the step must read (B * L * KVH * D * 2 tensors * 2 bytes) /
time, reported as a fraction of the device-to-device copy bandwidth measured in the same run
(bytes read + written / time). Baselines that would gather more than ``--max-gather-gb`` are
skipped (null).

Also: a launch-shape sweep (:class:`TileConfig`) on a few decode and prefill cases, and prefill
timings (TFLOP/s) against SDPA. Writes ``benchmarks/results/kernels_<device>.json``.

Usage (GPU)::

    python benchmarks/attn_kernels.py
    python benchmarks/attn_kernels.py --smoke   # tiny shapes; on CPU with TRITON_INTERPRET=1
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
from torch.nn import functional as F  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python benchmarks/attn_kernels.py` from the repo root
    sys.path.insert(0, str(ROOT))

from pagedllm.attention.backends.torch_native import TorchNativeBackend  # noqa: E402
from pagedllm.attention.backends.triton_backend import TritonBackend  # noqa: E402
from pagedllm.attention.metadata import AttentionMetadata  # noqa: E402
from pagedllm.ops.paged_attention import (  # noqa: E402
    TileConfig,
    choose_num_splits,
    paged_attention,
)

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
G = NUM_HEADS // NUM_KV_HEADS
DTYPE = torch.bfloat16


def bench(fn: Callable[[], Any], device: torch.device, graph: bool = True) -> float:
    """Median milliseconds of ``fn``; on CUDA timed with events around CUDA-graph replays
    (``graph``) or eager calls, L2 flushed between runs. CPU: wall clock, median of 3."""
    if device.type != "cuda":
        fn()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return sorted(times)[1]
    if graph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # compile / warm up outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run: Callable[[], Any] = g.replay
    else:
        run = fn
    ms = float(triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median"))
    if graph:
        del g
    return ms


def copy_bandwidth_gbps(device: torch.device, nbytes: int) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written (GB/s)."""
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src), device, graph=False)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def _random_cache(num_blocks: int, device: torch.device, seed: int) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    shape = (2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return torch.randn(shape, generator=g, device=device, dtype=DTYPE)


class Step:
    """One decode step: B requests of ``context`` tokens (the last one is the new token)."""

    def __init__(self, batch: int, context: int, device: torch.device, seed: int) -> None:
        g = torch.Generator(device=device).manual_seed(seed)
        nblk = context // BLOCK_SIZE
        self.batch, self.context, self.device = batch, context, device
        self.kv_cache = _random_cache(batch * nblk, device, seed)
        perm = torch.randperm(batch * nblk, generator=g, device=device)
        self.block_tables = perm.view(batch, nblk).to(torch.int32)  # [B, nblk] scattered blocks
        self.query = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=g, device=device).to(DTYPE)
        self.key = torch.randn(batch, NUM_KV_HEADS, HEAD_DIM, generator=g, device=device).to(DTYPE)
        self.value = torch.randn_like(self.key)
        self.qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        # The new token sits at position context - 1: last block, last offset.
        self.slots = self.block_tables[:, -1].long() * BLOCK_SIZE + (context - 1) % BLOCK_SIZE
        self.scale = HEAD_DIM**-0.5

    @property
    def kv_bytes(self) -> int:
        per_token = NUM_KV_HEADS * HEAD_DIM * 2 * self.kv_cache.element_size()  # K and V
        return self.batch * self.context * per_token

    def attention(
        self, num_splits: int | None, cfg: TileConfig | None = None
    ) -> Callable[[], torch.Tensor]:
        out = torch.empty_like(self.query)
        return lambda: paged_attention(
            self.query,
            self.kv_cache,
            self.qsl,
            self.seq_lens,
            self.block_tables,
            1,
            self.context,
            self.scale,
            None,
            out=out,
            num_splits=num_splits,
            tile_config=cfg,
        )

    def metadata(self, host_plan: bool) -> AttentionMetadata:
        md = AttentionMetadata(
            num_reqs=self.batch,
            num_actual_tokens=self.batch,
            query_start_loc=self.qsl,
            seq_lens=self.seq_lens,
            slot_mapping=self.slots,
            block_tables=self.block_tables,
            max_query_len=1,
            max_seq_len=self.context,
            block_size=BLOCK_SIZE,
        )
        if host_plan:  # the CPU backend plans on the host, once (its index tensors on the GPU)
            md.query_start_loc_np = self.qsl.cpu().numpy().astype("int64")
            md.seq_lens_np = self.seq_lens.cpu().numpy()
            md.plan["block_tables_np"] = self.block_tables.cpu().numpy()
            TorchNativeBackend()._plan(md, None, self.query.device, self.kv_cache.dtype)
        return md

    def backend(self, backend: Any, md: AttentionMetadata) -> Callable[[], Any]:
        return lambda: backend.forward(
            self.query, self.key, self.value, self.kv_cache, md, self.scale, None
        )

    def gathered(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V as contiguous [B, KVH, L, D] (what a gather-then-SDPA backend produces)."""
        b, nblk = self.block_tables.shape
        k = self.kv_cache[0][self.block_tables.long()]  # [B, nblk, bs, KVH, D]
        v = self.kv_cache[1][self.block_tables.long()]
        shape = (b, nblk * BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        return (
            k.view(shape).transpose(1, 2).contiguous(),
            v.view(shape).transpose(1, 2).contiguous(),
        )

    def sdpa(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # GQA decode as plain attention: the G query heads of a KV head become G query rows.
        q = self.query.view(self.batch, NUM_KV_HEADS, G, HEAD_DIM)
        return F.scaled_dot_product_attention(q, k, v, scale=self.scale)


def run_decode_case(step: Step, max_gather_bytes: float, splits: list[int]) -> dict[str, Any]:
    dev = step.device
    row: dict[str, Any] = {"batch": step.batch, "context": step.context, "kv_bytes": step.kv_bytes}
    row["auto_num_splits"] = choose_num_splits(step.batch, NUM_KV_HEADS, 1, step.context, dev)
    t: dict[str, float | None] = {}
    t["triton_auto"] = bench(step.attention(None), dev)
    t["triton_auto_eager"] = bench(step.attention(None), dev, graph=False)
    t["triton_unified"] = bench(step.attention(1), dev)
    best = (math.inf, 0)
    for s in splits:
        t[f"split_{s}"] = bench(step.attention(s), dev)
        best = min(best, (t[f"split_{s}"], s))
    t["triton_split"], row["best_split"] = best
    t["triton_backend"] = bench(step.backend(TritonBackend(), step.metadata(False)), dev)
    if step.kv_bytes <= max_gather_bytes:
        k, v = step.gathered()
        t["sdpa_pregathered"] = bench(lambda: step.sdpa(k, v), dev)
        ref = step.sdpa(k, v).reshape(step.batch, NUM_HEADS, HEAD_DIM).float()
        got = step.attention(None)().float()
        err = ((got - ref).norm() / ref.norm()).item()
        row["rel_err_vs_sdpa"] = err
        assert err < 1e-2, f"kernel disagrees with SDPA: rel err {err}"
        del k, v
        t["gather_sdpa"] = bench(lambda: step.sdpa(*step.gathered()), dev)
        md = step.metadata(True)
        t["torch_native_backend"] = bench(step.backend(TorchNativeBackend(), md), dev, False)
    else:
        t.update(sdpa_pregathered=None, gather_sdpa=None, torch_native_backend=None)
    row["ms"] = t
    row["kv_GBps"] = {k: (step.kv_bytes / (ms * 1e-3) / 1e9 if ms else None) for k, ms in t.items()}
    return row


# ---------------------------------------------------------------------------------------------
# Prefill: chunks attending over cached context, against SDPA on contiguous K/V.
# ---------------------------------------------------------------------------------------------


class Prefill:
    """``batch`` prefill chunks of ``q_len`` tokens after ``ctx`` cached ones."""

    def __init__(self, batch: int, q_len: int, ctx: int, device: torch.device, seed: int):
        g = torch.Generator(device=device).manual_seed(seed)
        seq = q_len + ctx
        nblk = -(-seq // BLOCK_SIZE)
        self.batch, self.q_len, self.ctx, self.device = batch, q_len, ctx, device
        self.kv_cache = _random_cache(batch * nblk, device, seed)
        perm = torch.randperm(batch * nblk, generator=g, device=device)
        self.block_tables = perm.view(batch, nblk).to(torch.int32)
        n = batch * q_len
        self.query = torch.randn(n, NUM_HEADS, HEAD_DIM, generator=g, device=device).to(DTYPE)
        self.qsl = torch.arange(0, n + 1, q_len, dtype=torch.int32, device=device)
        self.seq_lens = torch.full((batch,), seq, dtype=torch.int32, device=device)
        self.scale = HEAD_DIM**-0.5
        # Causal FLOPs: query i of a chunk sees ctx + i + 1 keys; 2 matmuls x 2 FLOPs per MAC.
        keys_seen = batch * (q_len * ctx + q_len * (q_len + 1) // 2)
        self.flops = 4 * NUM_HEADS * HEAD_DIM * keys_seen

    def attention(self, cfg: TileConfig | None = None) -> Callable[[], torch.Tensor]:
        out = torch.empty_like(self.query)
        return lambda: paged_attention(
            self.query,
            self.kv_cache,
            self.qsl,
            self.seq_lens,
            self.block_tables,
            self.q_len,
            self.q_len + self.ctx,
            self.scale,
            None,
            out=out,
            tile_config=cfg,
        )

    def sdpa(self) -> Callable[[], torch.Tensor]:
        """SDPA over pre-gathered, GQA-expanded contiguous K/V (causal, bottom-right aligned)."""
        b, nblk = self.block_tables.shape
        seq = self.q_len + self.ctx
        shape = (b, nblk * BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        kv = [
            self.kv_cache[i][self.block_tables.long()].view(shape)[:, :seq].transpose(1, 2)
            for i in (0, 1)
        ]
        k, v = (x.repeat_interleave(G, dim=1).contiguous() for x in kv)  # [B, H, seq, D]
        q = self.query.view(b, self.q_len, NUM_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
        if self.ctx == 0:
            return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        qp = torch.arange(self.ctx, seq, device=self.device)
        mask = torch.arange(seq, device=self.device)[None, :] <= qp[:, None]
        return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)


def run_prefill_case(p: Prefill) -> dict[str, Any]:
    dev = p.device
    sdpa = p.sdpa()
    ref = sdpa().transpose(1, 2).reshape(p.query.shape).float()  # [B * q, H, D]
    got = p.attention()().float()
    err = ((got - ref).norm() / ref.norm()).item()
    assert err < 1e-2, f"prefill kernel disagrees with SDPA: rel err {err}"
    t = {"triton": bench(p.attention(), dev), "sdpa_pregathered": bench(sdpa, dev)}
    return {
        "rel_err_vs_sdpa": err,
        "batch": p.batch,
        "q_len": p.q_len,
        "ctx": p.ctx,
        "ms": t,
        "TFLOPs": {k: p.flops / (ms * 1e-3) / 1e12 for k, ms in t.items()},
    }


def run_sweep(dev: torch.device, smoke: bool) -> list[dict[str, Any]]:
    """Launch shapes on a few cases: decode (forced path) and prefill."""
    rows: list[dict[str, Any]] = []
    if smoke:
        decode_cases, prefill_cases = [(1, 128, 4)], [(1, 64, 64)]
        cfgs = [TileConfig(16, 32)]
        pcfgs = [TileConfig(64, 32)]
    else:
        decode_cases = [(1, 32768, 64), (32, 4096, 4), (256, 4096, 1), (1, 512, 1)]
        prefill_cases = [(1, 4096, 0), (4, 512, 3584)]
        cfgs = [
            TileConfig(16, tn, w, st)
            for tn, w, st in [
                (32, 4, 2),
                (64, 4, 2),
                (64, 4, 3),
                (64, 4, 4),
                (128, 4, 2),
                (128, 8, 2),
                (128, 8, 3),
            ]
        ]
        pcfgs = [
            TileConfig(bm, tn, w, st)
            for bm, tn, w, st in [
                (64, 64, 4, 2),
                (64, 64, 4, 3),
                (128, 64, 8, 2),
                (128, 64, 8, 3),
                (128, 32, 4, 2),
                (64, 32, 4, 3),
            ]
        ]
    for b, ctx, splits in decode_cases:
        step = Step(b, ctx, dev, seed=11)
        for cfg in cfgs:
            ms = bench(step.attention(splits, cfg), dev)
            rows.append(
                {"kind": "decode", "batch": b, "context": ctx, "num_splits": splits,
                 "config": cfg.__dict__, "ms": ms, "kv_GBps": step.kv_bytes / (ms * 1e-3) / 1e9}
            )  # fmt: skip
        del step
    for b, q, ctx in prefill_cases:
        p = Prefill(b, q, ctx, dev, seed=12)
        for cfg in pcfgs:
            ms = bench(p.attention(cfg), dev)
            rows.append(
                {"kind": "prefill", "batch": b, "q_len": q, "ctx": ctx, "config": cfg.__dict__,
                 "ms": ms, "TFLOPs": p.flops / (ms * 1e-3) / 1e12}
            )  # fmt: skip
        del p
    return rows


def git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batches", default="1,32,256")
    ap.add_argument("--contexts", default="512,4096,32768")
    ap.add_argument("--splits", default="2,4,8,16,32,64", help="split counts to time")
    ap.add_argument("--max-gather-gb", type=float, default=8.0)
    ap.add_argument("--no-sweep", action="store_true", help="skip the launch-shape sweep")
    ap.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter works)")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        args.batches, args.contexts, args.splits = "1,2", "64,128", "2"
    elif dev.type != "cuda":
        sys.exit("no CUDA device: run with --smoke for a CPU check of the script")
    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    splits = [int(x) for x in args.splits.split(",")]
    device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor()
    copy_gbps = copy_bandwidth_gbps(dev, 2 << 30 if dev.type == "cuda" else 64 << 20)
    print(f"device: {device_name}; copy bandwidth {copy_gbps:.0f} GB/s (read + write)", flush=True)

    rows = []
    for b in batches:
        for ctx in contexts:
            step = Step(b, ctx, dev, seed=b * 7 + ctx)
            row = run_decode_case(step, args.max_gather_gb * 1e9, splits)
            row["fraction_of_copy_bw"] = {
                k: (gbps / copy_gbps if gbps else None) for k, gbps in row["kv_GBps"].items()
            }
            rows.append(row)
            del step
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            ms = row["ms"]
            frac = row["fraction_of_copy_bw"]["triton_auto"]
            print(
                f"B={b:4d} L={ctx:6d} splits={row['auto_num_splits']:2d} "
                f"auto {ms['triton_auto']:.4f} ms ({frac:.2f} of copy bw)",
                flush=True,
            )

    prefill = []
    cases = [(1, 64, 0), (2, 32, 64)] if args.smoke else [(1, 4096, 0), (4, 512, 3584)]
    for b, q, ctx in cases:
        prefill.append(run_prefill_case(Prefill(b, q, ctx, dev, seed=5)))
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    sweep = [] if args.no_sweep else run_sweep(dev, args.smoke)

    result = {
        "benchmark": "kernels-paged-attention",
        "device": device_name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "git_commit": git_commit(),
        "workload": {
            "num_heads": NUM_HEADS,
            "num_kv_heads": NUM_KV_HEADS,
            "head_dim": HEAD_DIM,
            "block_size": BLOCK_SIZE,
            "dtype": str(DTYPE),
            "batches": batches,
            "contexts": contexts,
            "smoke": args.smoke,
        },
        "copy_bandwidth_GBps": copy_gbps,
        "decode": rows,
        "prefill": prefill,
        "sweep": sweep,
    }
    name = re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_").lower() or "cpu"
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"kernels_{name}{'_smoke' if args.smoke else ''}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    print_tables(result)


def print_tables(result: dict[str, Any]) -> None:
    print(f"\nsweep (ms): {len(result['sweep'])} rows in the JSON")
    for r in result["sweep"]:
        c = r["config"]
        shape = f"B={r['batch']} " + (
            f"L={r['context']} s={r['num_splits']}"
            if r["kind"] == "decode"
            else f"q={r['q_len']} ctx={r['ctx']}"
        )
        metric = f"{r['kv_GBps']:.0f} GB/s" if "kv_GBps" in r else f"{r['TFLOPs']:.0f} TFLOP/s"
        print(
            f"  {r['kind']:7s} {shape:22s} m{c['block_m']} n{c['tile_n']} w{c['num_warps']} "
            f"st{c['num_stages']}: {r['ms']:.4f} ms {metric}"
        )
    print("\nprefill: ms (TFLOP/s)")
    for r in result["prefill"]:
        cells = [f"{k} {ms:.3f} ({r['TFLOPs'][k]:.0f})" for k, ms in r["ms"].items()]
        print(f"  B={r['batch']} q={r['q_len']} ctx={r['ctx']}: " + ", ".join(cells))
    cols = [
        "triton_auto",
        "triton_auto_eager",
        "triton_unified",
        "triton_split",
        "triton_backend",
        "sdpa_pregathered",
        "gather_sdpa",
        "torch_native_backend",
    ]
    print("\ndecode: fraction of copy bandwidth (K/V bytes / time); [auto ms, splits, best split]")
    print(f"{'B':>4} {'L':>6} " + " ".join(f"{c[:12]:>12}" for c in cols))
    for r in result["decode"]:
        cells = []
        for c in cols:
            f = r["fraction_of_copy_bw"][c]
            cells.append(f"{f:12.3f}" if f is not None else f"{'-':>12}")
        print(
            f"{r['batch']:>4} {r['context']:>6} "
            + " ".join(cells)
            + f"  [{r['ms']['triton_auto']:.4f} ms, {r['auto_num_splits']}, {r['best_split']}]"
        )
    print("decode split sweep (ms):")
    for r in result["decode"]:
        ss = {k: v for k, v in r["ms"].items() if k.startswith("split_") or k == "triton_unified"}
        print(
            f"  B={r['batch']} L={r['context']}: " + " ".join(f"{k}={v:.4f}" for k, v in ss.items())
        )


if __name__ == "__main__":
    main()
