"""Per-step attention metadata: where each request's queries and keys are."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    """Describes one flattened batch of tokens from several requests.

    Request r owns query rows ``query_start_loc[r]:query_start_loc[r+1]``; its keys are the
    first ``seq_lens[r]`` tokens of its sequence, stored in the blocks ``block_tables[r]``.
    Query row i of request r sits at position ``seq_lens[r] - query_len[r] + i`` and sees keys
    at positions <= its own (and > position - window on sliding-window layers).

    Example: a prefill chunk of 3 tokens after 5 cached ones, and a decode at position 9:
    query_start_loc [0, 3, 4], seq_lens [8, 10], query positions [5, 6, 7, 9].
    ``slot_mapping[t]`` is the cache slot (block_id * block_size + offset) where token t's new
    K/V go; -1 means "do not write" (padding rows).

    KV-cache groups (``core/kv_cache/spec.py``): with several, each group has its own block
    tables and slots; ``groups[g]`` is group g's metadata (``groups[0]`` is this object) and
    an attention layer reads ``for_group(its group)``. Everything else is shared.
    """

    num_reqs: int
    num_actual_tokens: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_reqs, max_blocks_per_req] int32
    max_query_len: int
    max_seq_len: int
    block_size: int
    # Host copies for backends that plan on the CPU.
    query_start_loc_np: np.ndarray | None = None
    seq_lens_np: np.ndarray | None = None
    # Backend-private per-step plans (e.g. gathered key slots), built once, shared by layers.
    plan: dict = field(default_factory=dict)
    groups: list[AttentionMetadata] | None = None
    # KV-Compress: the layer's scores and the step's scoring plan (kvcompress/attention.py);
    # then slot_mapping is [T, H], block_tables [R, H, max_blocks] and seq_lens [R, H]
    kvc: Any = None
    # fp8 caches with calculate_kv_scales: this pass sets every layer's scales from its K/V
    # before writing them (kv_layout.calibrate_scales; the first eager pass with real tokens)
    calibrate_kv_scales: bool = False
    # decode context parallelism: (this rank, ranks) of the DCP group. Then each rank stores
    # every ranks-th position (``kv_layout.dcp_slot_mapping``): slot_mapping holds this
    # rank's slots (-1 for the others'), block_size is a page's tokens (the scheduler's block
    # size / ranks), seq_lens stay whole (the queries' positions); ``attention/dcp.py``
    dcp: tuple[int, int] | None = None

    def for_group(self, group: int) -> AttentionMetadata:
        """The metadata a layer of KV-cache group ``group`` attends with."""
        return self if self.groups is None else self.groups[group]

    def set_groups(self, slot_mapping: torch.Tensor, block_tables: torch.Tensor) -> None:
        """Give each KV-cache group its metadata: ``slot_mapping`` [G, num_tokens] and
        ``block_tables`` [G, num_reqs, max_blocks], row g for group g (this object keeps row 0,
        which it already holds). Both stay whole in ``plan["all_groups"]`` (one copy each into
        a CUDA graph's buffers)."""
        self.groups = [self] + [
            self.with_tables(slot_mapping[g], block_tables[g])
            for g in range(1, slot_mapping.shape[0])
        ]
        self.plan["all_groups"] = (slot_mapping, block_tables)

    def with_tables(
        self, slot_mapping: torch.Tensor, block_tables: torch.Tensor
    ) -> AttentionMetadata:
        """A copy for another group: its own slots, tables and backend plans."""
        return replace(
            self, slot_mapping=slot_mapping, block_tables=block_tables, plan={}, groups=None
        )
