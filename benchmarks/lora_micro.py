"""The LoRA kernels alone on a GPU (``pagedllm/ops/lora.py``): microseconds a call of the
shrink and the expand for each projection of the Qwen3-0.6B shape, a decode step's tokens
spread evenly over K adapter slots, rank 16, bf16; the launch parameters swept (M tile,
split-K) and the defaults' time per decode step over all layers against the base model's own
projection matmuls (and the shrink with split-K off):

    python benchmarks/lora_micro.py --tokens 256 --slots 4,16 --out DIR

Each timing is a CUDA graph of 20 calls replayed 20 times (launch costs included as in a
captured decode step), the median of 5 replays. The JSON lands in DIR as
``lora_micro_<device>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.gpu_suite import provenance  # noqa: E402
from pagedllm.lora.batch import segments  # noqa: E402
from pagedllm.ops.lora import _block_m, lora_expand, lora_shrink, shrink_split_k  # noqa: E402

# Qwen3-0.6B: (name, in features, sub-projection sizes); 28 layers
SHAPES = [("qkv_proj", 1024, [2048, 1024, 1024]), ("o_proj", 2048, [1024]),
          ("gate_up_proj", 1024, [3072, 3072]), ("down_proj", 3072, [1024])]  # fmt: skip
LAYERS, RANK, CALLS = 28, 16, 20


def graph_us(fn) -> float:  # noqa: ANN001
    """Microseconds a call of ``fn``, captured CALLS times in one CUDA graph."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(CALLS):
            fn()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (20 * CALLS))
    return float(np.median(times))


def case(tokens: int, slots: int, k_in: int, subs: list[int]) -> dict:
    dev = torch.device("cuda")
    S, N = len(subs), sum(subs)
    slot_of = np.repeat(np.arange(slots), -(-tokens // slots))[:tokens]  # contiguous runs
    order, starts, counts = segments(slot_of, slots)
    meta = torch.from_numpy(np.concatenate([order, starts, counts]).astype(np.int64)).to(dev)
    x = torch.randn(tokens, k_in, device=dev, dtype=torch.bfloat16)
    a = torch.randn(slots, S * RANK, k_in, device=dev, dtype=torch.bfloat16) * 0.02
    b = torch.randn(slots, N, RANK, device=dev, dtype=torch.bfloat16) * 0.02
    w = torch.randn(N, k_in, device=dev, dtype=torch.bfloat16) * 0.02
    out = torch.zeros(tokens, N, device=dev, dtype=torch.bfloat16)
    flat = [sum(subs[:i]) for i in range(S)] + subs
    ranges = torch.tensor(flat, dtype=torch.int64, device=dev)
    row: dict = {"base_matmul_us": graph_us(lambda: torch.matmul(x, w.T))}
    sweep = {}
    for bm in (16, 32, 64):
        for split in (1, 2, 4, 8, 12, 16):
            if split > 1 and k_in // split < 64:
                continue
            sweep[f"bm{bm}_split{split}"] = graph_us(
                lambda bm=bm, split=split: lora_shrink(x, a, meta, tokens, RANK, bm, split)
            )
    row["shrink_us"] = sweep
    row["shrink_unsplit_us"] = sweep[f"bm{_block_m(tokens)}_split1"]  # split-K off
    row["shrink_default_us"] = graph_us(lambda: lora_shrink(x, a, meta, tokens, RANK))
    row["default"] = {"block_m": _block_m(tokens), "split_k": shrink_split_k(tokens, k_in)}
    s = lora_shrink(x, a, meta, tokens, RANK)
    row["expand_us"] = {f"bm{bm}": graph_us(
        lambda bm=bm: lora_expand(s, b, out, meta, ranges, tokens, max(subs), bm))
        for bm in (16, 32, 64)}  # fmt: skip
    row["expand_default_us"] = row["expand_us"][f"bm{_block_m(tokens)}"]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="256,64")
    p.add_argument("--slots", default="4,16")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    device = torch.cuda.get_device_name()
    result: dict = {**provenance("lora-micro"), "device": device, "rank": RANK,
                    "layers": LAYERS, "cases": []}  # fmt: skip
    for t in (int(v) for v in args.tokens.split(",")):
        for n in (int(v) for v in args.slots.split(",")):
            per_step = {"base_ms": 0.0, "lora_ms": 0.0, "shrink_ms": 0.0, "shrink_unsplit_ms": 0.0}
            for name, k_in, subs in SHAPES:
                r = case(t, n, k_in, subs)
                r.update(tokens=t, slots=n, projection=name)
                result["cases"].append(r)
                per_step["base_ms"] += LAYERS * r["base_matmul_us"] / 1e3
                per_step["lora_ms"] += (
                    LAYERS * (r["shrink_default_us"] + r["expand_default_us"]) / 1e3
                )
                per_step["shrink_ms"] += LAYERS * r["shrink_default_us"] / 1e3
                per_step["shrink_unsplit_ms"] += LAYERS * r["shrink_unsplit_us"] / 1e3
                print(t, n, name, {k: v for k, v in r.items() if k.endswith("_us") and
                                   not isinstance(v, dict)}, flush=True)  # fmt: skip
            result.setdefault("per_decode_step", []).append({"tokens": t, "slots": n, **per_step})
            print(t, n, per_step, flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"lora_micro_{device.replace(' ', '_')}.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
