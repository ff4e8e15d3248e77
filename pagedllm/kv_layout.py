"""The KV cache's layout: where a token's K/V live, and every copy of whole blocks.

One object owns it, so no other module computes a slot:

- Tensors. ``layers_per_group`` tensors of [2, num_blocks, block_size, num_kv_heads, head_dim]
  (0 = K, 1 = V); layer ``j`` of every KV-cache group uses tensor ``j`` (see
  ``core/kv_cache/spec.py``: with one group, one tensor per layer, as always).
- Slots. Token at position p of a request lives in block ``table[p // block_size]`` at offset
  ``p % block_size``: slot ``table[p // bs] * bs + p % bs``; slot -1 means "no write".
- Block copies (copy-on-write of a forked block) and swap (device <-> host blocks) act on every
  tensor at once: a block id names the same page in all of them.

The attention backends get their slots and key positions from here; the Triton kernels take
the tensors and the block tables and apply the same arithmetic on the device.

fp8 caches (``--kv-cache-dtype fp8``): the tensors are ``torch.float8_e4m3fn``, half the bytes
of bfloat16. Each attention layer holds ``kv_scale`` [2, num_kv_heads] float32 (0 = K, 1 = V):
a cached element is ``fp8(clamp(x / scale, -448, 448))`` and reads back as ``fp8 * scale``.
The scales are 1.0 (vLLM's default), the checkpoint's ``k_scale`` / ``v_scale`` where it has
them, or (``calculate_kv_scales``) set once from the first step with real tokens:
max |K| / 200 and max |V| / 100 per KV head (vLLM's constants: K may grow 2.2x, V 4.5x past
the first prompt's largest before it clips at 448). Block copies and swaps move bytes
(``uint8`` views: PyTorch has no indexed copy of float8 on a CPU).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np
import torch

from pagedllm.core.kv_cache.spec import KVCacheGroups

logger = logging.getLogger(__name__)


def token_slots(block_table: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """Slots of key ``positions`` through ``block_table``: one table [max_blocks] with
    positions [P], or a table per row [rows, max_blocks] with positions per row [rows, P].

    Example: block_size 4, block_table [7, 2], positions [0..5] -> [28, 29, 30, 31, 8, 9].
    """
    blocks = np.take_along_axis(block_table, positions // block_size, axis=-1)
    return blocks.astype(np.int64) * block_size + positions % block_size


def slot_mapping(
    block_tables: np.ndarray, token_rows: np.ndarray, positions: np.ndarray, block_size: int
) -> np.ndarray:
    """[num_groups, num_tokens] slots of each token in each KV-cache group's table.

    block_tables: [num_groups, num_rows, max_blocks]; token t is in row token_rows[t] at
    positions[t]. Example: bs 16, group 0 row table [7, 3], position 20 -> 3 * 16 + 4 = 52.
    """
    blocks = block_tables[:, token_rows, positions // block_size]  # [G, num_tokens]
    return blocks.astype(np.int64) * block_size + positions % block_size


# Decode context parallelism (``decode_context_parallel_size`` D): the D ranks of a DCP group
# share the block tables, and rank r stores the positions p with p % D == r, its j-th such
# position at local index j = p // D. A table's block spans ``block_size`` (B) positions, and
# each rank's page holds its B / D of them: local index j sits in block table[j // (B / D)]
# at offset j % (B / D), so a rank's share is a plain paged cache of block size B / D over the
# same tables (position p = j * D + r lies in block (j * D + r) // B = j // (B / D)).
# Example: D 2, B 4, table [7, 3]: positions 0..7 -> ranks 0 1 0 1 0 1 0 1; rank 1 holds
# positions 1, 3 in block 7 (offsets 0, 1) and 5, 7 in block 3.


def dcp_local_lens(seq_lens: np.ndarray, rank: int, size: int) -> np.ndarray:
    """How many of the first ``seq_lens`` positions DCP rank ``rank`` of ``size`` stores:
    the p < L with p % size == rank. Example: size 2, L [1, 4, 5] -> rank 0 [1, 2, 3],
    rank 1 [0, 2, 2]."""
    return np.maximum(np.asarray(seq_lens) - rank + size - 1, 0) // size


def dcp_slot_mapping(
    block_tables: np.ndarray,
    token_rows: np.ndarray,
    positions: np.ndarray,
    block_size: int,
    rank: int,
    size: int,
) -> np.ndarray:
    """``slot_mapping`` for DCP rank ``rank`` of ``size``: the slots of its own positions in
    its pages of ``block_size // size`` tokens, -1 (no write) for the other ranks'.

    Example: size 2, bs 4 (pages of 2), table [7, 3], positions [4, 5]: both local index 2
    -> block table[2 // 2] = 3, offset 0 -> slot 6; rank 0 [6, -1], rank 1 [-1, 6]."""
    page = block_size // size
    local = positions // size  # [num_tokens]
    blocks = block_tables[:, token_rows, local // page]  # [G, num_tokens]
    slots = blocks.astype(np.int64) * page + local % page
    return np.where(positions % size == rank, slots, -1)


FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
K_SCALE_CONSTANT = 200.0  # calculate_kv_scales: scale = max |K| / 200 (vLLM's constant)
V_SCALE_CONSTANT = 100.0


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether a cache of ``dtype`` stores scaled float8 (see the module docstring)."""
    return dtype == FP8


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` as uint8 where it is float8 (for indexed copies), else ``t`` itself."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t


def kv_cache_dtype(fp8: bool, model_config: Any, device: torch.device) -> torch.dtype:
    """The cache tensors' dtype: the model's, or float8 e4m3 (``kv_cache_dtype`` fp8), which
    a GPU reads only from compute capability 8.9 (Ada, Hopper) on."""
    if not fp8:
        return model_config.torch_dtype
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError(
            "kv_cache_dtype 'fp8' needs a GPU of compute capability 8.9 or newer (Ada, "
            "Hopper): the attention kernels convert float8 e4m3 in registers."
        )
    return FP8


def copy_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the byte movers index a cache of ``dtype`` as (``as_bytes``)."""
    return torch.uint8 if is_fp8(dtype) else dtype


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp8(clamp(x / scale, -448, 448)); x [n, num_kv_heads, head_dim], scale [num_kv_heads].
    Example: scale 0.5, x 1.3 -> 2.6 -> e4m3 2.5 (reads back as 1.25)."""
    return (x.float() / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Cached K or V rows [..., num_kv_heads, head_dim] in ``dtype``: times ``scale``
    [num_kv_heads] where the cache is fp8, else a plain cast."""
    if not is_fp8(x.dtype):
        return x.to(dtype)
    assert scale is not None, "an fp8 cache needs its scales"
    return (x.float() * scale[:, None]).to(dtype)


def calibrate_scales(kv_scale: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """``kv_scale`` [2, num_kv_heads] from one step's K and V [n, num_kv_heads, head_dim]:
    max |K| / K_SCALE_CONSTANT and max |V| / V_SCALE_CONSTANT per KV head (a head of zeros
    keeps a tiny positive scale). In place: a captured CUDA graph reads the new values."""
    k_amax = key.detach().abs().amax(dim=(0, 2)).float()  # [num_kv_heads]
    v_amax = value.detach().abs().amax(dim=(0, 2)).float()
    kv_scale[0].copy_((k_amax / K_SCALE_CONSTANT).clamp_(min=1e-6))
    kv_scale[1].copy_((v_amax / V_SCALE_CONSTANT).clamp_(min=1e-6))


def write_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """Reference KV write: kv_cache[0/1].view(-1, kvh, d)[slot] = key/value[t]; slot -1 skipped.

    key/value: [num_tokens, num_kv_heads, head_dim]; slot_mapping: [n] (n <= num_tokens);
    an fp8 cache quantizes with ``kv_scale`` [2, num_kv_heads]."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    k_flat = kv_cache[0].view(-1, num_kv_heads, head_dim)
    v_flat = kv_cache[1].view(-1, num_kv_heads, head_dim)
    n = slot_mapping.shape[0]
    slots = slot_mapping
    if bool((slots < 0).any()):
        keep = slots >= 0
        slots, key, value = slots[keep], key[:n][keep], value[:n][keep]
    key, value = key[: slots.shape[0]], value[: slots.shape[0]]
    if is_fp8(kv_cache.dtype):
        assert kv_scale is not None, "an fp8 cache needs its scales"
        key, value = quantize_fp8(key, kv_scale[0]), quantize_fp8(value, kv_scale[1])
    as_bytes(k_flat).index_copy_(0, slots, as_bytes(key.to(k_flat.dtype)))
    as_bytes(v_flat).index_copy_(0, slots, as_bytes(value.to(v_flat.dtype)))


def block_pages(tensors: list[torch.Tensor]) -> list[int]:
    """Each tensor's page in bytes (a [2, num_blocks, *page] tensor)."""
    return [math.prod(t.shape[2:]) * t.element_size() for t in tensors]


def copy_block_rows_ref(
    tensors: list[torch.Tensor], ids: torch.Tensor, rows: torch.Tensor, to_rows: bool
) -> None:
    """``rows`` [n, row_bytes] (uint8) from (``to_rows``) or into the blocks ``ids`` [n] of
    each ``[2, num_blocks, *page]`` tensor: row i is block ids[i] of every tensor back to back,
    tensor t's K page then its V page (``worker/offload.page_layout``). The CPU's path, and
    the reference of the GPU's one-launch kernel (``ops/block_rows.py``)."""
    n, offset = rows.shape[0], 0
    for t, size in zip(tensors, block_pages(tensors)):
        part = rows[:, offset : offset + 2 * size].view(t.dtype).view(n, 2, *t.shape[2:])
        if to_rows:
            part.copy_(t.index_select(1, ids).transpose(0, 1))
        else:
            t.index_copy_(1, ids, part.transpose(0, 1))
        offset += 2 * size


class KVScales:
    """An fp8 cache's scales: one [2, num_kv_heads] float32 tensor per attention layer (0 = K,
    1 = V), the checkpoint's where it gave some, else 1.0, made at the first ``bind`` and kept
    across re-binds; with ``calculate`` (``calculate_kv_scales``) the first eager forward pass
    with real tokens sets them (``finish_metadata``). Another dtype: no scales, and the layers'
    ``kv_scale`` is None. Both layouts own one (this module's and KV-Compress's)."""

    def __init__(self, dtype: torch.dtype, device: torch.device, calculate: bool = False) -> None:
        self.fp8 = is_fp8(dtype)
        self.device = device
        self.scales: list[torch.Tensor] = []
        self.calibrate_pending = calculate and self.fp8

    def bind(self, layers: list[torch.nn.Module]) -> None:
        """Set each attention layer's ``kv_scale`` (its scales, or None)."""
        if self.fp8 and not self.scales:
            for layer in layers:
                scale = torch.ones(2, layer.num_kv_heads, dtype=torch.float32)
                ckpt = getattr(layer, "checkpoint_kv_scale", None)
                if ckpt is not None:
                    scale.copy_(ckpt)
                self.scales.append(scale.to(self.device))
        for i, layer in enumerate(layers):
            layer.kv_scale = self.scales[i] if self.fp8 else None

    def finish_metadata(self, md: Any) -> None:
        """Mark the first eager pass with real tokens to calibrate (``calculate``)."""
        if self.calibrate_pending and md.num_actual_tokens > 0:
            md.calibrate_kv_scales = True
            self.calibrate_pending = False


class KVCacheLayout:
    """The KV cache tensors of one device, their host (swap) copies, and block arithmetic."""

    def __init__(
        self,
        groups: KVCacheGroups,
        dtype: torch.dtype,
        device: torch.device,
        calculate_scales: bool = False,
    ) -> None:
        self.groups = groups
        self.dtype = dtype  # the cache tensors' (torch.float8_e4m3fn for an fp8 cache)
        self.device = device
        self.kv_scales = KVScales(dtype, device, calculate_scales)
        self.block_size = groups.block_size
        self.num_groups = groups.num_groups
        self.num_blocks = 0
        self.tensors: list[torch.Tensor] = []  # [2, num_blocks, bs, kvh, d] each
        self.host_tensors: list[torch.Tensor] = []  # same, num_host_blocks

    @property
    def block_bytes(self) -> int:
        """Bytes of one block id across every cache tensor (K and V)."""
        return self.groups.block_bytes

    @property
    def bytes_per_token(self) -> float:
        return self.block_bytes / self.block_size

    def _make(self, num_blocks: int, device: torch.device | str, pin: bool) -> list[torch.Tensor]:
        return [
            torch.zeros(
                2, num_blocks, *spec.page_shape, dtype=self.dtype, device=device, pin_memory=pin
            )
            for spec in self.groups.tensor_specs()
        ]

    def allocate(self, num_blocks: int) -> list[torch.Tensor]:
        """Allocate (zeroed) device tensors of ``num_blocks`` blocks."""
        self.num_blocks = num_blocks
        self.tensors = self._make(num_blocks, self.device, False)
        return self.tensors

    def allocate_host(self, num_blocks: int) -> None:
        """Host blocks for swap preemption (pinned when the device is a GPU)."""
        pin = self.device.type == "cuda"
        host = self._make(num_blocks, "cpu", pin) if num_blocks > 0 else []
        self.host_tensors = [as_bytes(t) for t in host]  # indexed like copy_tensors

    def release(self) -> None:
        self.tensors = []
        self.num_blocks = 0

    @property
    def copy_tensors(self) -> list[torch.Tensor]:
        """The cache tensors as the byte movers (swap, the host tier, KV transfer) index them:
        uint8 views of an fp8 cache, else the tensors themselves."""
        return [as_bytes(t) for t in self.tensors]

    def bind(self, layers: list[torch.nn.Module]) -> None:
        """Give each attention layer its index, its group and its cache tensor, and with an
        fp8 cache its scales (``kv_scale``: the checkpoint's where it gave some, else 1.0;
        kept across re-binds); other caches get ``kv_scale`` None."""
        where = self.groups.layer_position()
        self.kv_scales.bind(layers)
        for i, layer in enumerate(layers):
            g, j = where[i]
            layer.layer_idx, layer.kv_group = i, g
            layer.kv_cache = self.tensors[j] if self.tensors else torch.empty(0)

    @property
    def scales(self) -> list[torch.Tensor]:
        """An fp8 cache's scales, one [2, num_kv_heads] per attention layer ([] otherwise)."""
        return self.kv_scales.scales

    # --------------------------------------------------------------- whole blocks
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block src -> block dst in every tensor (K and V)."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        for cache in self.copy_tensors:
            cache.index_copy_(1, dst, cache.index_select(1, src))

    def swap(self, out_pairs: list[tuple[int, int]], in_pairs: list[tuple[int, int]]) -> None:
        """Copy (device, host) ``out_pairs`` to host memory, then (host, device) ``in_pairs``
        back, before the forward pass may overwrite the freed device blocks."""
        if out_pairs:
            src = torch.tensor([d for d, _ in out_pairs], device=self.device)
            dst = torch.tensor([h for _, h in out_pairs])
            for dev, host in zip(self.copy_tensors, self.host_tensors):
                host.index_copy_(1, dst, dev.index_select(1, src).cpu())
        if in_pairs:
            src = torch.tensor([h for h, _ in in_pairs])
            dst = torch.tensor([d for _, d in in_pairs], device=self.device)
            for dev, host in zip(self.copy_tensors, self.host_tensors):
                dev.index_copy_(1, dst, host.index_select(1, src).to(self.device))

    # ------------------------------------------------------- the runner's layout hooks
    # (a per-head layout overrides them: kvcompress/runner.py; worker/kv_connector.py)
    def add_rows(self, batch: Any, new_reqs: list, so: Any = None) -> list[int]:
        """Rows for the requests new to the runner (``InputBatch.add_request``, which copies
        their block tables); the rows, in order."""
        return [batch.add_request(new) for new in new_reqs]

    def update_rows(self, batch: Any, cached_rows: list[tuple]) -> None:
        """The changes of the requests the runner holds (``SchedulerOutput.cached_rows``):
        copy-on-write replaced entries, tokens the scheduler appends, new blocks, and
        computed counts, into the input batch."""
        rows = batch.req_id_to_row
        for req_id, new_block_ids, num_computed, replaced, append in cached_rows:
            row = rows[req_id]
            for g, idx, block_id in replaced:
                batch.block_table[g, row, idx] = block_id
            for token in append:
                batch.append_token(row, token)
            if new_block_ids:
                batch.append_blocks(row, new_block_ids)
            batch.num_computed_tokens[row] = num_computed

    def blocks_per_request(self, max_model_len: int, max_num_tokens: int, max_blocks: int) -> int:
        """Blocks one ``max_model_len`` request holds at most, over every group's table."""
        return sum(
            min(max_blocks, g.spec.max_blocks_needed(max_model_len, max_num_tokens) + 1)
            for g in self.groups.groups
        )

    def begin_dummy(self, inputs: Any, rows: Any, n_sched: Any, num_blocks: int) -> None:
        """Before the profiling pass over ``rows`` (nothing to do: the input batch's tables
        are the plain layout's)."""

    def end_dummy(self, num_rows: int) -> None:
        """After the profiling pass."""

    def finish_metadata(self, md: Any) -> None:
        """Before an eager forward pass (a CUDA-graph replay skips it): the first one with
        real tokens calibrates an fp8 cache's scales where ``calculate_kv_scales`` asks."""
        self.kv_scales.finish_metadata(md)

    def capture_graphs(self, runner: Any) -> bool:
        """Capture this layout's own CUDA graphs on ``runner``; False: the runner's plain
        decode graphs apply. First (GPU, eager too) the prefill kernels' start-up passes
        (``warm_up_prefill_kernels``)."""
        warm_up_prefill_kernels(runner, self.num_blocks, self.dtype)
        return False


def warm_up_prefill_kernels(runner: Any, num_blocks: int, cache_dtype: torch.dtype) -> list[int]:
    """One profiling-style pass (``_dummy_run``: dummy tokens, no scales calibrated) per
    variant of the attention kernels that steps with prompt tokens meet, which run eagerly:
    else the first step whose longest row picks a new tile shape - e.g. a prompt's last 5
    tokens beside decode rows - stalls for its Triton compile in the middle of serving.
    Returns the passes' lengths (the backend's ``prefill_variant_query_lens``)."""
    sched = runner.config.scheduler_config
    max_len = min(runner.max_model_len, sched.max_num_batched_tokens or runner.max_model_len)
    itemsize = torch.empty(0, dtype=cache_dtype).element_size()
    lens: set[int] = set()
    for a in runner.model.attention_layers():
        g = a.num_heads // a.num_kv_heads
        lens.update(runner.backend.prefill_variant_query_lens(
            a.head_dim, g, runner.device, itemsize, max_len
        ))  # fmt: skip
    with torch.inference_mode():
        for q in sorted(lens):
            runner._dummy_run(q, num_blocks)
    return sorted(lens)
