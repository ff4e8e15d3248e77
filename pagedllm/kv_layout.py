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
"""

from __future__ import annotations

import logging
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


def write_kv_ref(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Reference KV write: kv_cache[0/1].view(-1, kvh, d)[slot] = key/value[t]; slot -1 skipped.

    key/value: [num_tokens, num_kv_heads, head_dim]; slot_mapping: [n] (n <= num_tokens)."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    k_flat = kv_cache[0].view(-1, num_kv_heads, head_dim)
    v_flat = kv_cache[1].view(-1, num_kv_heads, head_dim)
    n = slot_mapping.shape[0]
    slots = slot_mapping
    if bool((slots < 0).any()):
        keep = slots >= 0
        slots, key, value = slots[keep], key[:n][keep], value[:n][keep]
    k_flat.index_copy_(0, slots, key[: slots.shape[0]].to(k_flat.dtype))
    v_flat.index_copy_(0, slots, value[: slots.shape[0]].to(v_flat.dtype))


class KVCacheLayout:
    """The KV cache tensors of one device, their host (swap) copies, and block arithmetic."""

    def __init__(self, groups: KVCacheGroups, dtype: torch.dtype, device: torch.device) -> None:
        self.groups = groups
        self.dtype = dtype
        self.device = device
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
        self.host_tensors = self._make(num_blocks, "cpu", pin) if num_blocks > 0 else []

    def release(self) -> None:
        self.tensors = []
        self.num_blocks = 0

    def bind(self, layers: list[torch.nn.Module]) -> None:
        """Give each attention layer its index, its group and its cache tensor."""
        where = self.groups.layer_position()
        for i, layer in enumerate(layers):
            g, j = where[i]
            layer.layer_idx, layer.kv_group = i, g
            layer.kv_cache = self.tensors[j] if self.tensors else torch.empty(0)

    # --------------------------------------------------------------- whole blocks
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block src -> block dst in every tensor (K and V)."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        for cache in self.tensors:
            cache.index_copy_(1, dst, cache.index_select(1, src))

    def swap(self, out_pairs: list[tuple[int, int]], in_pairs: list[tuple[int, int]]) -> None:
        """Copy (device, host) ``out_pairs`` to host memory, then (host, device) ``in_pairs``
        back, before the forward pass may overwrite the freed device blocks."""
        if out_pairs:
            src = torch.tensor([d for d, _ in out_pairs], device=self.device)
            dst = torch.tensor([h for _, h in out_pairs])
            for dev, host in zip(self.tensors, self.host_tensors):
                host.index_copy_(1, dst, dev.index_select(1, src).cpu())
        if in_pairs:
            src = torch.tensor([h for h, _ in in_pairs])
            dst = torch.tensor([d for _, d in in_pairs], device=self.device)
            for dev, host in zip(self.tensors, self.host_tensors):
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
        """Before an eager forward pass (a CUDA-graph replay skips it): nothing here."""

    def capture_graphs(self, runner: Any) -> bool:
        """Capture this layout's own CUDA graphs on ``runner``; False: the runner's plain
        decode graphs apply."""
        return False
