"""A/B of the compiled CPU attention kernels (``pagedllm/ops/cpu/paged_attention.cpp``): the
file at a base commit against the working tree's, both built here with the set-up's flags, on
one step's shape, in bfloat16 and float32. Rounds alternate base / new (the machine's speed
drifts); outputs are compared.

- ``--op decode`` (default): SmolLM2-135M's decode step by default: 64 requests of ~300 keys,
  9 query heads, 3 KV heads, head size 64, blocks of 16;
- ``--op prefill``: ``paged_prefill`` on 8 first chunks of 256 tokens, the same heads.

    .venv/bin/python benchmarks/cpu_kernel_ab.py --base HEAD~1 [--op prefill] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SOURCE = "pagedllm/ops/cpu/paged_attention.cpp"
# as pagedllm/ops/cpu, plus AB_EXTRA_FLAGS (e.g. -DNAME=value for a compile-time experiment)
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno"]
FLAGS += os.environ.get("AB_EXTRA_FLAGS", "").split()


def _build(name: str, source: Path, folder: Path):  # noqa: ANN202
    from torch.utils.cpp_extension import load

    folder.mkdir(parents=True, exist_ok=True)
    return load(name=name, sources=[str(source)], extra_cflags=FLAGS,
                build_directory=str(folder), verbose=False)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="the commit whose kernel is the baseline")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--keys", type=int, default=320)
    ap.add_argument(
        "--layers",
        type=int,
        default=1,
        help="caches run in turn (30: SmolLM2's layers, ~470 MB: K/V come from DRAM as in a "
        "real step; 1: one ~16 MB cache, which stays in this Xeon's L3)",
    )
    ap.add_argument("--op", default="decode", choices=["decode", "prefill"])
    ap.add_argument("--prompts", type=int, default=8, help="--op prefill: chunks a call")
    ap.add_argument("--tokens", type=int, default=256, help="--op prefill: a chunk's tokens")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="cpu_kernel_ab_"))
    base_src = tmp / "base.cpp"
    base_src.write_text(subprocess.check_output(["git", "show", f"{args.base}:{SOURCE}"],
                                                cwd=ROOT, text=True))  # fmt: skip
    mods = {"base": _build("cpu_ab_base", base_src, tmp / "base"),
            "new": _build("cpu_ab_new", ROOT / SOURCE, tmp / "new")}  # fmt: skip
    torch.manual_seed(0)
    B, H, KVH, D, bs, L = args.requests, 9, 3, 64, 16, args.keys
    result: dict = {
        "benchmark": f"cpu {args.op} kernel A/B (compiled kernel only, alternating rounds)",
        "base": subprocess.check_output(["git", "rev-parse", args.base], cwd=ROOT,
                                        text=True).strip(),  # fmt: skip
        "new": "working tree of " + os.environ.get("PAGEDLLM_COMMIT", "?"),
        "shape": {"requests": B, "heads": H, "kv_heads": KVH, "head_dim": D, "block_size": bs,
                  "keys": f"{L - 40}-{L}", "caches_in_turn": args.layers},  # fmt: skip
        "device": platform.processor() or platform.machine(),
        "cpu": next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo")
                     if x.startswith("model name")), "?"),  # fmt: skip
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "by_dtype": {},
    }
    if args.op == "prefill":
        result["shape"] = {"prompts": args.prompts, "tokens": args.tokens, "heads": H,
                           "kv_heads": KVH, "head_dim": D, "block_size": bs}  # fmt: skip
    for dtype in (torch.bfloat16, torch.float32):
        if args.op == "prefill":
            times, outs = _prefill_rounds(mods, args, dtype, H, KVH, D, bs)
        else:
            times, outs = _decode_rounds(mods, args, dtype, B, H, KVH, D, bs, L)
        med = {n: sorted(v)[len(v) // 2] for n, v in times.items()}
        row = {"ms_per_call_median": med, "ms_per_call_all": times,
               "speedup": med["base"] / med["new"],
               "max_abs_diff": float((outs["base"].float() - outs["new"].float()).abs().max())}
        result["by_dtype"][str(dtype).replace("torch.", "")] = row
        print(f"{dtype}: base {med['base']:.3f} ms, new {med['new']:.3f} ms "
              f"({row['speedup']:.2f}x), max diff {row['max_abs_diff']:.2e}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
        print("wrote", args.out)


def _decode_rounds(mods, args, dtype, B, H, KVH, D, bs, L):  # noqa: ANN001, ANN202
    """Times (ms a call, per round) and last outputs of paged_decode, base and new in turn."""
    nb = B * (L // bs + 1) + 4
    caches = [
        (torch.randn(nb, bs, KVH, D).to(dtype), torch.randn(nb, bs, KVH, D).to(dtype))
        for _ in range(args.layers)
    ]
    kc, vc = caches[0]
    q = torch.randn(B, H, D).to(dtype)
    tables = torch.randperm(nb - 1)[: B * (L // bs + 1)].view(B, -1).int()
    lens = torch.randint(L - 40, L + 1, (B,)).int()
    times: dict = {n: [] for n in mods}
    outs = {}
    for _ in range(args.rounds):
        for n, m in mods.items():
            outs[n] = m.paged_decode(q, kc, vc, tables, lens, D**-0.5, 0)
            calls = max(10, len(caches))
            t = time.perf_counter()
            for i in range(calls):
                k_i, v_i = caches[i % len(caches)]
                m.paged_decode(q, k_i, v_i, tables, lens, D**-0.5, 0)
            times[n].append((time.perf_counter() - t) / calls * 1e3)
    return times, outs


def _prefill_rounds(mods, args, dtype, H, KVH, D, bs):  # noqa: ANN001, ANN202
    """Times (ms a call, per round) and last outputs of paged_prefill on first chunks."""
    n, t = args.prompts, args.tokens
    per = (t + bs - 1) // bs
    nb = n * per + 4
    kc, vc = torch.randn(nb, bs, KVH, D).to(dtype), torch.randn(nb, bs, KVH, D).to(dtype)
    q = torch.randn(n * t, H, D).to(dtype)
    q_starts = torch.arange(n, dtype=torch.int64) * t
    q_lens = torch.full((n,), t, dtype=torch.int32)
    tables = torch.randperm(nb)[: n * per].view(n, per).int()
    times: dict = {k: [] for k in mods}
    outs = {k: torch.empty_like(q) for k in mods}
    for _ in range(args.rounds):
        for k, m in mods.items():
            m.paged_prefill(q, kc, vc, q_starts, q_lens, q_lens, tables, D**-0.5, 0, outs[k])
            calls = 10
            t0 = time.perf_counter()
            for _ in range(calls):
                m.paged_prefill(q, kc, vc, q_starts, q_lens, q_lens, tables, D**-0.5, 0, outs[k])
            times[k].append((time.perf_counter() - t0) / calls * 1e3)
    return times, outs


if __name__ == "__main__":
    main()
