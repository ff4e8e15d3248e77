"""The prompt's window scores at Llama-3.1-8B's shape, one layer: torch against the kernel.

When a prefill chunk ends its prompt, KV-Compress scores the prompt's keys from its last 32
queries (squared softmax probabilities summed over those queries and the 4 query heads of each
KV head, max-pooled over 7 keys). ``prefill_window_scores_batched`` did it in torch (a
[requests, heads, 4, 32, keys] float32 logits tensor, its softmax, a gather of every key as
float32, a dozen launches); ``kvc_window_scores`` does it in one pass over the keys from the
normalizers the prefill kernel stores (``kvc_paged_attention(lse=...)``), plus a max-pool
launch. This times one layer's call of each (32 query heads over 8 KV heads, head_dim 128,
bf16, block 16) for the prompts that end in one step, eager (as the engine's mixed steps run)
and in a CUDA graph, the prefill kernel with and without storing the normalizers, and checks
the two scores against each other.

Usage (GPU): python benchmarks/kvc_window_micro.py [--out DIR]
(``--smoke``: two small prompts on the CPU through Triton's interpreter, to check the script.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.kernels import bench, write_gpu_result  # noqa: E402
from pagedllm.kvcompress.attention import KVCStepPlan, prefill_window_scores_batched  # noqa: E402
from pagedllm.ops.kvc_attention import kvc_paged_attention, kvc_window_scores  # noqa: E402

BS, HEAD_DIM, HEADS, KV_HEADS, WINDOW, POOL = 16, 128, 32, 8, 32, 7


def case(prompts: list[int], dev: torch.device, graph: bool) -> dict:
    """One step whose chunks are whole prompts of these lengths, every one ending."""
    g = torch.Generator(device=dev).manual_seed(0)
    r = len(prompts)
    nblk = [-(-n // BS) for n in prompts]
    total = sum(nblk) * KV_HEADS
    perm = torch.randperm(total, generator=g, device=dev).to(torch.int32)
    width = max(nblk)
    tables = torch.zeros((r, KV_HEADS, width), dtype=torch.int32, device=dev)
    at = 0
    for i, n in enumerate(nblk):
        tables[i, :, :n] = perm[at : at + n * KV_HEADS].view(KV_HEADS, n)
        at += n * KV_HEADS
    lens = torch.tensor(prompts, device=dev)[:, None].expand(r, KV_HEADS).contiguous()
    kv = torch.randn((2, total, BS, HEAD_DIM), generator=g, device=dev).to(torch.bfloat16)
    t = sum(prompts)
    query = torch.randn((t, HEADS, HEAD_DIM), generator=g, device=dev).to(torch.bfloat16)
    qsl = np.concatenate([[0], np.cumsum(prompts)])
    idx = KVCStepPlan.index_arrays(
        np.zeros(0, dtype=np.int64), np.arange(r), qsl, np.arange(r), np.full(r, WINDOW)
    )
    ten = {k: torch.from_numpy(np.asarray(v)).long().to(dev) for k, v in idx.items()}
    scale, max_len = HEAD_DIM**-0.5, max(prompts)
    out = torch.empty_like(query)
    lse = torch.empty((t, HEADS), dtype=torch.float32, device=dev)
    scores_t = torch.zeros(total * BS, device=dev)
    scores_k = torch.zeros(total * BS, device=dev)

    def prefill(with_lse: bool):
        return lambda: kvc_paged_attention(
            query, kv, ten["prefill_qsl"], lens, tables, max_len, scale,
            row_ids=ten["prefill_table_rows"], q_start=ten["prefill_q_start"], out=out,
            lse=lse if with_lse else None,
        )  # fmt: skip

    def torch_window():
        prefill_window_scores_batched(
            query, kv[0].view(-1, HEAD_DIM), tables[ten["window_reqs"]],
            lens[ten["window_reqs"]], ten["window_rows"], ten["window_mask"].bool(), BS, scale,
            scores_t, POOL, max_len,
        )  # fmt: skip

    def kernel_window():
        kvc_window_scores(
            query, kv, lse, tables, lens, ten["window_reqs"], ten["window_rows"],
            ten["window_n"], scale, scores_k, POOL, max_len,
        )  # fmt: skip

    prefill(True)()
    torch_window()
    kernel_window()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    assert scores_t.sum() > 0, "no score added"
    diff = (scores_t - scores_k).abs().max().item()
    rel = diff / max(scores_t.abs().max().item(), 1e-30)
    res = {
        "prompts": prompts,
        "graph": graph,
        "prefill_ms": bench(prefill(False), dev, graph=graph),
        "prefill_lse_ms": bench(prefill(True), dev, graph=graph),
        "window_torch_ms": bench(torch_window, dev, graph=graph),
        "window_kernel_ms": bench(kernel_window, dev, graph=graph),
        "scores_max_abs_diff": diff,
        "scores_max_rel_diff": rel,
    }
    res["window_speedup"] = res["window_torch_ms"] / res["window_kernel_ms"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cpu" if args.smoke else "cuda")
    cases = [[40, 70]] if args.smoke else [[6000], [500], [2000, 2000, 2000, 2000], [14000]]
    rows = []
    for prompts in cases:
        for graph in (False,) if args.smoke else (False, True):
            res = case(prompts, dev, graph)
            rows.append(res)
            print(json.dumps({k: (float(f"{v:.4g}") if isinstance(v, float) else v)
                              for k, v in res.items()}), flush=True)  # fmt: skip
    if args.out:
        shape = {"shape": "llama-3.1-8b one layer", "window": WINDOW, "maxpool": POOL}
        write_gpu_result(args.out, "kvc_window_micro", {**shape, "rows": rows})


if __name__ == "__main__":
    main()
