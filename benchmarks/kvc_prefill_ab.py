"""KV-Compress prefill attention on a GPU: the per-head kernel (``kvc_paged_attention``, rows read
and written in place) against the standard paged kernel on the same tokens, and optionally
against an older ``kvc_attention.py`` (``--old PATH``: its pseudo-request path, with the
per-layer gathers the backend did around it).

Shapes: A, Benchmark A's mixed step (Qwen3-0.6B: 16 query / 8 KV heads, head 128; 4 chunks
of 512 tokens among 200 decode rows of ~600 keys; only the chunks timed); B, Benchmark B's
prefill step (Llama-3.1-8B: 32 / 8 heads; 8 prompts of 1,024 tokens). bf16, block size 16,
each layer's tables a view of the whole [rows, layers x heads, max_blocks] tables as in the
engine. Times: CUDA events, median of 30 calls after a warm-up.

  python benchmarks/kvc_prefill_ab.py [--old benchmarks/results/tmp/kvc_attention_old.py]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os

import numpy as np
import torch

from pagedllm.ops.kvc_attention import kvc_paged_attention
from pagedllm.ops.paged_attention import paged_attention

SHAPES = {
    # name: (query heads, KV heads, chunk lengths, decode rows, decode context, layers)
    "A-mixed": (16, 8, [512] * 4, 200, 600, 28),
    "B-prefill": (32, 8, [1024] * 8, 0, 0, 32),
}


def timed(fn, reps: int = 30) -> float:  # noqa: ANN001
    """Median milliseconds of ``fn()`` on the current stream."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return float(np.median(times))


def run_shape(name: str, old) -> dict:  # noqa: ANN001
    hq, h, chunks, n_dec, dec_ctx, layers = SHAPES[name]
    d, bs, dev, dtype = 128, 16, torch.device("cuda"), torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    q_lens = chunks + [1] * n_dec
    order = torch.randperm(len(q_lens), generator=gen).tolist()  # decodes among the chunks
    q_lens = [q_lens[i] for i in order]
    r = len(q_lens)
    ctx = [dec_ctx if q == 1 else 0 for q in q_lens]
    lens_req = torch.tensor([c + q for c, q in zip(ctx, q_lens)])  # every head alike
    max_blocks = 2048 // bs + 1
    nblk = (lens_req + bs - 1) // bs
    num_blocks = int(nblk.sum()) * h + 16
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    lh, layer = layers * h, 1
    tables = torch.zeros(r + 1, lh, max_blocks, dtype=torch.int32)
    lens = torch.zeros(r + 1, lh, dtype=torch.int64)
    rows = torch.randperm(r + 1, generator=gen)[:r]  # each request's table row
    used = 0
    std_tables = torch.zeros(r, max_blocks, dtype=torch.int32)
    for i in range(r):
        n = int(nblk[i])
        for hh in range(h):
            tables[rows[i], layer * h + hh, :n] = perm[used : used + n]
            used += n
        std_tables[i, :n] = perm[i * n : (i + 1) * n]  # standard layout: one table a request
        lens[rows[i], layer * h : (layer + 1) * h] = lens_req[i]
    part = slice(layer * h, (layer + 1) * h)
    t_tables, t_lens = tables.to(dev)[:, part], lens.to(dev)[:, part]
    kv = torch.randn(2, num_blocks, bs, d, generator=gen).to(dtype).to(dev)
    std_kv = torch.randn(2, num_blocks, bs, h, d, generator=gen).to(dtype).to(dev)
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    t = int(qsl[-1])
    query = torch.randn(t, hq, d, generator=gen).to(dtype).to(dev)
    pre = np.array([i for i, q in enumerate(q_lens) if q > 1])
    sub_qsl = np.concatenate([[0], np.cumsum([q_lens[i] for i in pre])])
    pre_rows = np.concatenate([np.arange(qsl[i], qsl[i + 1]) for i in pre])
    to = lambda a: torch.as_tensor(np.asarray(a), dtype=torch.int64, device=dev)  # noqa: E731
    sub_qsl_t, q_start_t, trows_t = to(sub_qsl), to(qsl[pre]), rows.to(dev)[to(pre)]
    rows_t = to(pre_rows)
    max_q = max(q_lens)
    out = torch.empty_like(query)
    scale = d**-0.5

    def new() -> None:
        kvc_paged_attention(query, kv, sub_qsl_t, t_lens, t_tables, max_q, scale,
                            row_ids=trows_t, q_start=q_start_t, out=out,
                            num_chunk_tokens=int(sub_qsl[-1]))  # fmt: skip

    res = {"shape": name, "query_heads": hq, "kv_heads": h, "chunks": chunks,
           "decode_rows": n_dec, "ms_new": timed(new)}  # fmt: skip
    # the standard layout: the same tokens through the standard paged kernel (every request)
    qsl32 = torch.as_tensor(qsl, dtype=torch.int32, device=dev)
    std_lens = lens_req.to(torch.int32).to(dev)
    std_t = std_tables.to(dev)
    res["ms_standard_all_rows"] = timed(
        lambda: paged_attention(
            query, std_kv, qsl32, std_lens, std_t, max_q, 2048, scale, out=out
        )  # fmt: skip
    )
    if old is not None:
        width = min(max_blocks, -(-int(lens_req.max()) // bs))
        layout = old.kvc_prefill_layout(sub_qsl_t, int(sub_qsl[-1]), h)

        def before() -> None:  # the backend before: gathers around the pseudo-request kernel
            sub_query = query[rows_t] if n_dec else query
            sub = old.kvc_paged_attention(
                sub_query, kv, sub_qsl_t, t_lens[trows_t], t_tables[trows_t, :, :width], max_q,
                int(lens_req.max()), scale, layout=layout,
            )  # fmt: skip
            if n_dec:
                out[rows_t] = sub
            else:
                out[: sub.shape[0]] = sub

        res["ms_old_with_gathers"] = timed(before)
        # outputs equal (the same kernel loop, other row order)
        before()
        ref = out[rows_t].float().clone()
        new()
        res["max_abs_diff_new_vs_old"] = float((out[rows_t].float() - ref).abs().max())
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", default="", help="path of an older kvc_attention.py to compare")
    ap.add_argument("--out", default="benchmarks/results")
    a = ap.parse_args()
    old = None
    if a.old:
        spec = importlib.util.spec_from_file_location("kvc_attention_old", a.old)
        assert spec is not None and spec.loader is not None
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
    dev_name = torch.cuda.get_device_name(0)
    result = {"device": dev_name, "git_commit": os.environ.get("PAGEDLLM_COMMIT"),
              "shapes": [run_shape(n, old) for n in SHAPES]}  # fmt: skip
    print(json.dumps(result, indent=1))
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"kvc_prefill_ab_{dev_name.replace(' ', '_')}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
