"""The roofline of a generation run: how fast it could have been on this device.

Each step must at least read every weight once and the live KV cache of its requests (memory
bound) and do 2 x params FLOPs per token plus the attention FLOPs (compute bound). The ideal
step time is the larger of bytes / bandwidth and FLOPs / peak FLOP/s; the ideal run time is the
sum over the steps the engine actually took. achieved fraction = ideal time / measured time.

A mixture of experts reads, in each MoE layer, only the experts its step's tokens touch, and
does each token's FLOPs over its k experts only. The experts touched by T tokens are counted
as their expected number under uniform routing, E (1 - (1 - k / E)^T) per layer (random dummy
weights route all but uniformly; a real router's skew touches fewer, so this roofline is then
a little lenient). Example: 128 experts, top-8: 1 token touches 8, 16 tokens 82.4, 256 all 128.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass
class StepRecord:
    """What one step computed: tokens per request and each request's context length after."""

    num_tokens: list[int]
    seq_lens: list[int]


@dataclass
class MoELayerCost:
    """One mixture-of-experts layer: its experts, top-k, and one expert's bytes and params."""

    num_experts: int
    top_k: int
    expert_bytes: int
    expert_params: int

    def touched(self, num_tokens: int) -> float:
        """Expected experts touched by ``num_tokens`` tokens under uniform routing."""
        e, k = self.num_experts, min(self.top_k, self.num_experts)
        return e * (1.0 - (1.0 - k / e) ** num_tokens)


@dataclass
class ModelCost:
    """Bytes and FLOPs of a model: weights, KV bytes per token, attention FLOPs per key; for a
    mixture of experts, its MoE layers (their experts are in the totals too)."""

    weight_bytes: int
    num_params: int
    kv_bytes_per_token: int
    attn_flops_per_query_key: int  # 4 x num_layers x num_heads x head_dim
    moe_layers: list[MoELayerCost] = field(default_factory=list)

    def step_weights(self, num_tokens: int) -> tuple[float, float]:
        """(weight bytes read, params used per token) of a step of ``num_tokens`` tokens."""
        nbytes, params = float(self.weight_bytes), float(self.num_params)
        for m in self.moe_layers:
            nbytes -= (m.num_experts - m.touched(num_tokens)) * m.expert_bytes
            params -= (m.num_experts - min(m.top_k, m.num_experts)) * m.expert_params
        return nbytes, params


@dataclass
class Roofline:
    """Ideal time of a recorded run and its parts."""

    ideal_s: float = 0.0
    memory_s: float = 0.0
    compute_s: float = 0.0
    bytes_read: float = 0.0
    flops: float = 0.0
    steps: int = 0
    decode_steps: int = 0
    details: dict = field(default_factory=dict)


def model_cost(
    model: torch.nn.Module, dtype: torch.dtype, kv_dtype: torch.dtype | None = None
) -> ModelCost:
    """Bytes and FLOPs of ``model`` with weights of ``dtype`` and a KV cache of ``kv_dtype``
    (default: ``dtype``; fp8 caches read one byte an element)."""
    params = list(model.parameters())
    uniq = {p.data_ptr(): p for p in params}.values()  # tied weights counted once
    num_params = sum(p.numel() for p in uniq)
    elem = torch.empty(0, dtype=dtype).element_size()
    kv_elem = torch.empty(0, dtype=kv_dtype or dtype).element_size()
    layers = model.attention_layers()  # type: ignore[operator]
    kv = sum(2 * a.num_kv_heads * a.head_dim * kv_elem for a in layers)
    attn = sum(4 * a.num_heads * a.head_dim for a in layers)
    from pagedllm.model.layers.moe import FusedMoE

    moe = []
    for m in model.modules():
        if isinstance(m, FusedMoE):
            per_expert = (m.w13.numel() + m.w2.numel()) // m.num_local
            moe.append(MoELayerCost(m.num_local, m.top_k, per_expert * elem, per_expert))
    return ModelCost(num_params * elem, num_params, kv, attn, moe)


def attended_keys(step: StepRecord) -> float:
    """(query, key) pairs a step's attention computes: each of a request's n new tokens
    attends to its context, on average seq_len - n / 2 keys.

    Example: 4 new tokens at seq_len 10 -> 4 x 8 = 32 (causally they attend to 7 + 8 + 9 +
    10 = 34 keys: the rule is the lower estimate)."""
    return sum(n * (sl - n / 2) for n, sl in zip(step.num_tokens, step.seq_lens))


def roofline(
    steps: list[StepRecord], cost: ModelCost, bandwidth: float, peak_flops: float
) -> Roofline:
    """Sum of per-step max(bytes / bandwidth, flops / peak) over the recorded steps."""
    r = Roofline()
    for s in steps:
        ctx = sum(s.seq_lens)
        toks = sum(s.num_tokens)
        weights, params = cost.step_weights(toks)
        nbytes = weights + ctx * cost.kv_bytes_per_token
        flops = 2 * params * toks + cost.attn_flops_per_query_key * attended_keys(s)
        m, c = nbytes / bandwidth, flops / peak_flops
        r.memory_s += m
        r.compute_s += c
        r.ideal_s += max(m, c)
        r.bytes_read += nbytes
        r.flops += flops
        r.steps += 1
        r.decode_steps += int(max(s.num_tokens) == 1)
    return r


def measure_copy_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Device copy bandwidth in bytes/s, counting bytes read + written (the read-only roofline
    for decode is about this number: HBM serves reads and writes from one budget)."""
    if device.type != "cuda":
        x = torch.empty(nbytes // 8, dtype=torch.uint8)
        y = torch.empty_like(x)
        y.copy_(x)
        t = time.perf_counter()
        for _ in range(3):
            y.copy_(x)
        return 3 * 2 * x.numel() / (time.perf_counter() - t)
    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        y.copy_(x)
    end.record()
    torch.cuda.synchronize()
    bw = 10 * 2 * nbytes / (start.elapsed_time(end) / 1e3)
    del x, y
    torch.cuda.empty_cache()
    return bw


def measure_matmul_flops(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> float:
    """Dense matmul FLOP/s (8192^3 on a GPU, 1024^3 on a CPU)."""
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    for _ in range(2):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    reps = 10
    for _ in range(reps):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    return reps * 2 * n**3 / (time.perf_counter() - t)
