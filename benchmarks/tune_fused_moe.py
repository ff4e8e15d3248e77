"""Tune the Triton fused MoE's block sizes for a model shape on this GPU (issue 55): for each
token count, every candidate of ``block_m`` and, under it, every candidate tile of the gate/up
GEMM and of the down GEMM is timed (``triton.testing.do_bench``); the fastest pair is checked
against the reference (``fused_experts_ref``) and merged into the table the kernel reads,
``pagedllm/ops/fused_moe_configs.json`` (``--out`` to write elsewhere), under the key of the
shape and the device (``pagedllm.ops.fused_moe.config_key``).

    python benchmarks/tune_fused_moe.py --model qwen3-30b-a3b        # on a GPU
    python benchmarks/tune_fused_moe.py --smoke --out /tmp/moe.json  # CPU: Triton's interpreter,
                                                                     # a tiny shape, two tiles
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TOKENS = "1,2,4,8,16,32,64,128,256,512,1024,2048,4096"
TILES = {"block_n": (64, 128), "block_k": (64, 128), "num_warps": (4, 8), "num_stages": (3, 4)}
SMOKE_TILES = {"block_n": (32,), "block_k": (16, 32), "num_warps": (4,), "num_stages": (2,)}


def shape_of(model: str) -> tuple[int, int, int, int]:
    """(experts, hidden, expert intermediate, top-k) of a built-in shape's config."""
    import transformers as tf

    from pagedllm.model.loader import resolve_model_path

    c = tf.AutoConfig.from_pretrained(resolve_model_path(model, "dummy"))
    experts = getattr(c, "num_experts", None) or c.num_local_experts
    inter = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
    return experts, c.hidden_size, inter, c.num_experts_per_tok


def timed(fn, cuda: bool) -> float:  # noqa: ANN001
    """Microseconds of one call (the median of do_bench on a GPU, one call on a CPU)."""
    if cuda:
        import triton

        return 1e3 * triton.testing.do_bench(fn, warmup=5, rep=20)
    t = time.perf_counter()
    fn()
    return 1e6 * (time.perf_counter() - t)


def tune(a: argparse.Namespace, save=None) -> dict:  # noqa: ANN001
    """The table's entries of ``a``'s shape on this device; ``save(table)`` is called after
    each token count (a run cut short keeps what it measured)."""
    import torch

    from pagedllm.model.layers.moe import fused_experts_ref, route
    from pagedllm.ops.activation import act_and_mul
    from pagedllm.ops.fused_moe import config_key, fused_moe, grouped_gemm, moe_align

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = getattr(torch, a.dtype)
    if a.smoke:
        experts, hidden, inter, top_k = 8, 64, 32, 2
    else:
        experts, hidden, inter, top_k = shape_of(a.model)
    tiles = SMOKE_TILES if a.smoke else TILES
    grid = [dict(zip(tiles, v)) for v in itertools.product(*tiles.values())]
    gen = torch.Generator().manual_seed(0)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(device, dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(device, dtype)
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    entries: dict = {}
    for t in [int(x) for x in a.tokens.split(",")]:
        x = torch.randn(t, hidden, generator=gen).to(device, dtype)
        logits = torch.randn(t, experts, generator=gen).to(device, dtype)
        weights, ids = route(logits, top_k, True, dtype)
        pairs = t * top_k
        best = None
        for block_m in (16, 32) if a.smoke else (16, 32, 64, 128):
            if block_m > 16 and pairs / experts < block_m / 4:
                continue  # most of each block would be padding
            aligned = moe_align(ids, experts + 1, block_m)
            flat = weights.reshape(-1).contiguous()
            up_args = (x, w13, aligned, pairs, top_k, block_m, None)
            up = min(grid, key=lambda g, u=up_args: timed(partial(grouped_gemm, *u, g), cuda))
            h = act_and_mul(grouped_gemm(*up_args, up), "silu")
            down_args = (h, w2, aligned, pairs, 1, block_m, flat)
            down = min(grid, key=lambda g, d=down_args: timed(partial(grouped_gemm, *d, g), cuda))
            cfg = {"block_m": block_m, "up": up, "down": down}
            us = timed(partial(fused_moe, x, w13, w2, weights, ids, cfg), cuda)
            if best is None or us < best[0]:
                best = (us, cfg)
        us, cfg = best
        ref = fused_experts_ref(x.float(), w13.float(), w2.float(), weights.float(), ids)
        got = fused_moe(x, w13, w2, weights, ids, cfg).float()
        torch.testing.assert_close(got, ref, atol=5e-2, rtol=5e-2)
        entries[str(t)] = {**cfg, "us": round(us, 2)}
        print(t, json.dumps(entries[str(t)]), flush=True)
        if save is not None:
            save({config_key(experts, hidden, inter, dtype, name): entries})
    return {config_key(experts, hidden, inter, dtype, name): entries}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3-30b-a3b", help="a built-in MoE shape")
    ap.add_argument("--tokens", default=TOKENS, help="token counts to tune for")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--smoke", action="store_true", help="a tiny shape and two tiles (CPU)")
    ap.add_argument("--out", default=str(ROOT / "pagedllm" / "ops" / "fused_moe_configs.json"))
    a = ap.parse_args()
    if a.smoke:
        a.tokens = "1,5" if a.tokens == TOKENS else a.tokens
    import torch

    if not torch.cuda.is_available():
        if not a.smoke:
            sys.exit("tuning needs a GPU (or --smoke, in Triton's interpreter)")
        os.environ.setdefault("TRITON_INTERPRET", "1")
    out = Path(a.out)
    merged = json.loads(out.read_text()) if out.exists() else {}

    def save(table: dict) -> None:
        merged.update(table)
        out.write_text(json.dumps(merged, indent=1, sort_keys=True) + "\n")

    tune(a, save)
    print("wrote", out)


if __name__ == "__main__":
    main()
