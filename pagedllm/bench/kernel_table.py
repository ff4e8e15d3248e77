"""The per-kernel table of a profiled run: each kind of kernel's device time against the bytes
it must move and the FLOPs it must do.

A kernel's limit is max(bytes / copy rate, FLOPs / matmul rate), both rates measured on the
same device in the same call (``roofline.measure_copy_bandwidth``: bytes read + written per
second of a large device copy; ``measure_matmul_flops``: a large bf16 matmul). Its fraction is
limit / measured time: 1.0 moves its bytes at the copy rate (or does its FLOPs at the matmul
rate). The bytes are each kind's least traffic for the profiled steps (``StepRecord``s):

    gemm           every linear weight once, plus its tokens' inputs and outputs; the LM head
                   on one row a request (its logits written in the activations' dtype, as
                   greedy steps keep them); FLOPs 2 x params x tokens
    attention      the live KV cache of every request (its context, all layers), the queries
                   read and the outputs written; FLOPs 4 x heads x head_dim a (query, key)
    rope           q and k read, q written, K and V written into the cache and V read (the
                   Triton kernel rotates, applies q/k norms and writes the cache in one pass)
    kv_write       K and V read and written into the cache (where no rope kernel does it)
    rms_norm       per hidden-size norm and token: the input and the residual read, both
                   written (the residual pre-norm; a norm without residual is counted the same)
    act_and_mul    per MLP and token: gate and up read, their product written
    moe            the experts the step's tokens touch (``MoELayerCost.touched``), FLOPs over
                   each token's top-k experts
    sampling       the logits of one row a request read once (in the activations' dtype)

Other kinds (copies, scatters, KV-Compress's scoring, anything unnamed) get their time only.
Kernels are sorted into kinds by name (``KERNEL_KINDS``, first match wins).

Example (Qwen3-0.6B shape, one decode step of 256 requests at 900 tokens of context each):
attention must read 256 x 900 x 114,688 bytes = 26.4 GB; at a 4.2 TB/s copy rate its limit is
6.3 ms, and a kernel taking 7.0 ms runs at 0.90 of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedllm.bench.roofline import ModelCost, StepRecord, attended_keys

KERNEL_KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("_unified_kernel", "_split_kernel", "_reduce_kernel", "_decode_kernel",
                   "_combine_kernel", "_prefill_kernel")),
    ("kvc_scores", ("_score",)),
    ("moe", ("fused_moe", "_moe_")),
    ("index_copy_scatter", ("index_copy", "scatter", "index_put", "indexFuncLarge",
                            "index_elementwise", "gather")),
    ("kv_write", ("kv_write", "_write_kv", "reshape_and_cache")),
    ("rope", ("_rope",)),
    ("rms_norm", ("rms",)),
    ("act_and_mul", ("act_and_mul", "_act")),
    ("gemm", ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas", "splitkreduce")),
    ("sampling", ("argmax", "ArgMax", "softmax", "topk", "sort", "exponential", "bitmask")),
)  # fmt: skip


def kernel_kind(name: str) -> str:
    """The kind of a kernel by its name ("other" when no pattern matches)."""
    return next((k for k, subs in KERNEL_KINDS if any(x in name for x in subs)), "other")


@dataclass(frozen=True)
class KernelCosts:
    """A model's per-token traffic by kernel kind (bytes), from its layers' shapes."""

    cost: ModelCost  # weights, KV bytes a token, attention FLOPs, MoE layers
    linear_weight_bytes: int  # every dense linear layer's weight (not the LM head, no experts)
    linear_params: int
    linear_io_elems: int  # per token: the sum of in + out features over those layers
    head_bytes: int  # the LM head's weight
    head_params: int
    hidden: int
    vocab: int
    elem: int  # the weights' and activations' bytes an element
    qo_bytes: int  # per token: every layer's queries read and outputs written by attention
    rope_bytes: int  # per token: q/k read, q written, K/V to the cache, V read
    kv_write_bytes: int  # per token: K and V read and written into the cache
    norm_bytes: int  # per token: the hidden-size norms
    act_bytes: int  # per token: the dense MLPs' act-and-mul


def kernel_costs(model: Any, cost: ModelCost, elem: int) -> KernelCosts:
    """The per-token traffic of ``model``'s kernels (``cost``: its ``roofline.model_cost``;
    ``elem``: the bytes of an activation element)."""
    from pagedllm.model.layers.activation import GeluAndMul, SiluAndMul
    from pagedllm.model.layers.embedding import LMHead
    from pagedllm.model.layers.linear import LinearBase
    from pagedllm.model.layers.moe import FusedMoE
    from pagedllm.model.layers.norm import RMSNorm

    lin_bytes = lin_params = io = head_bytes = head_params = vocab = hidden = 0
    acts = inter = 0
    norm_sizes: list[int] = []
    moe = False
    for name, m in model.named_modules():
        if isinstance(m, LinearBase):
            n = m.in_features * m.out_features
            lin_params += n
            lin_bytes += n * elem
            io += m.in_features + m.out_features
            if name.endswith("down_proj"):  # a dense MLP's width: its down projection's input
                inter = max(inter, m.in_features)
        elif isinstance(m, LMHead):
            vocab, hidden = m.weight.shape[0], m.weight.shape[1]
            head_params = vocab * hidden
            head_bytes = head_params * m.weight.element_size()
        elif isinstance(m, (SiluAndMul, GeluAndMul)):
            acts += 1
        elif isinstance(m, RMSNorm):
            norm_sizes.append(m.weight.numel())
        elif isinstance(m, FusedMoE):
            moe = True
    norms = norm_sizes.count(hidden)  # (q/k norms are head-sized: inside the rope kernel)
    if moe:
        acts = 0  # the experts' act-and-mul is inside the fused MoE kernels
    layers = model.attention_layers()
    kv_elem = cost.kv_bytes_per_token // max(
        1, sum(2 * a.num_kv_heads * a.head_dim for a in layers)
    )
    qo = sum(2 * a.num_heads * a.head_dim * elem for a in layers)
    rope = sum(
        a.head_dim * ((2 * a.num_heads + 2 * a.num_kv_heads) * elem + 2 * a.num_kv_heads * kv_elem)
        for a in layers
    )
    kvw = sum(2 * a.num_kv_heads * a.head_dim * (elem + kv_elem) for a in layers)
    return KernelCosts(
        cost=cost,
        linear_weight_bytes=lin_bytes,
        linear_params=lin_params,
        linear_io_elems=io,
        head_bytes=head_bytes,
        head_params=head_params,
        hidden=hidden,
        vocab=vocab,
        elem=elem,
        qo_bytes=qo,
        rope_bytes=rope,
        kv_write_bytes=kvw,
        norm_bytes=norms * 4 * hidden * elem,
        act_bytes=acts * 3 * inter * elem,
    )


def kind_work(kind: str, steps: list[StepRecord], kc: KernelCosts) -> tuple[float, float] | None:
    """(bytes, FLOPs) ``kind`` must at least move and do over ``steps``; None for a kind
    without a model (see the module docstring)."""
    nbytes = flops = 0.0
    for s in steps:
        toks, rows = sum(s.num_tokens), len(s.num_tokens)
        if kind == "gemm":
            nbytes += kc.linear_weight_bytes + toks * kc.linear_io_elems * kc.elem
            nbytes += kc.head_bytes + rows * (kc.hidden + kc.vocab) * kc.elem
            flops += 2.0 * (kc.linear_params * toks + kc.head_params * rows)
        elif kind == "attention":
            nbytes += sum(s.seq_lens) * kc.cost.kv_bytes_per_token + toks * kc.qo_bytes
            flops += kc.cost.attn_flops_per_query_key * attended_keys(s)
        elif kind == "rope":
            nbytes += toks * kc.rope_bytes
        elif kind == "kv_write":
            nbytes += toks * kc.kv_write_bytes
        elif kind == "rms_norm":
            nbytes += toks * kc.norm_bytes
        elif kind == "act_and_mul":
            nbytes += toks * kc.act_bytes
        elif kind == "sampling":
            nbytes += rows * kc.vocab * kc.elem
        elif kind == "moe" and kc.cost.moe_layers:
            for m in kc.cost.moe_layers:
                nbytes += m.touched(toks) * m.expert_bytes
                flops += 2.0 * toks * m.top_k * m.expert_params
        else:
            return None
    return nbytes, flops


def kernel_table(
    kind_ms: dict[str, float],
    steps: list[StepRecord],
    kc: KernelCosts,
    bandwidth: float,
    peak_flops: float,
) -> list[dict]:
    """One row per kind, slowest first: ms a step, bytes and FLOPs a step, the limit's ms a
    step, the fraction of it reached, and what bounds it ("memory" or "compute"); kinds
    without a model carry their time only. ``kind_ms``: device ms over all of ``steps``."""
    n = max(1, len(steps))
    rows = []
    for kind, ms in sorted(kind_ms.items(), key=lambda kv: -kv[1]):
        row: dict[str, Any] = {"kind": kind, "ms_per_step": ms / n}
        work = kind_work(kind, steps, kc)
        if work is not None:
            nbytes, flops = work
            mem_ms, cmp_ms = 1e3 * nbytes / bandwidth, 1e3 * flops / peak_flops
            limit = max(mem_ms, cmp_ms)
            row.update(
                bytes_per_step=nbytes / n,
                flops_per_step=flops / n,
                limit_ms_per_step=limit / n,
                fraction_of_limit=limit / ms if ms > 0 else None,
                bound="compute" if cmp_ms > mem_ms else "memory",
            )
        rows.append(row)
    return rows
