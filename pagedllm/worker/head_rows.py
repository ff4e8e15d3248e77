"""KV-Compress's per-head blocks moved as whole rows: the prefill/decode transfers
(``worker/kv_transfer.py``) and the host KV tier (``worker/offload.py``) copy a block index of
every (layer, KV head) at once, in the plain cache's block-major layout
(``core/kv_transfer/files.layout_of``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pagedllm.utils.pinned import PinnedRing


class HeadRows:
    """KV-Compress's per-head blocks as transfer rows (``files.layout_of``): row i holds block
    i of every layer's KV heads on this rank, each layer's ``[2, block_size, Hr, head_dim]``
    page as a plain cache's, gathered from (or scattered into) one block per head of the
    per-head pool ``kv [2, num_blocks, block_size, head_dim]``. A loaded slot also gets its
    token's position (row i's j-th slot: position i * block_size + j) and a zero score, as a
    computed one (``HeadPagedCache.prepare_step``).

    Example: 2 layers, Hr 2, heads [[5, 9, 2, 7]] (the blocks of l0h0, l0h1, l1h0, l1h1 for
    row 3) -> the row is layer 0's page, K then V, each token's keys of blocks 5 and 9 side
    by side ([2, bs, 2, d]), then layer 1's of blocks 2 and 7; loading it writes positions
    48..63 (bs 16) into each of the four blocks' slots."""

    def __init__(self, cache: Any, ids: PinnedRing) -> None:
        self.cache = cache
        self.ids = ids
        self.shard = cache.shard
        self.layers, self.heads = cache.num_layers, cache.num_kv_heads
        self.bs = cache.block_size
        self.width = cache.head_dim * torch.empty(0, dtype=cache.dtype).element_size()

    def _local(self, heads: np.ndarray) -> torch.Tensor:
        """[n, LH] every rank's block ids -> this rank's, [n * L * Hr] (row, layer, head)
        order, on the device."""
        shard = self.shard
        if shard.world > 1:
            heads = heads[:, shard.mine] - shard.rank * shard.num_blocks
        return self.ids.ship(np.ascontiguousarray(heads, dtype=np.int64).reshape(-1))

    def _kv(self) -> torch.Tensor:
        """[2, num_blocks, bs, head_dim * itemsize] the pool's bytes."""
        return self.cache.kv.view(torch.uint8)

    def _rows(self, rows: torch.Tensor) -> torch.Tensor:
        """[n, row_bytes] bytes -> [n, L, 2, bs, Hr, head_dim bytes]."""
        return rows.view(rows.shape[0], self.layers, 2, self.bs, self.heads, self.width)

    def gather(self, heads: np.ndarray, rows: torch.Tensor) -> None:
        """Rows ``[n, row_bytes]`` from the blocks ``heads`` [n, LH]."""
        n = heads.shape[0]
        src = self._kv().index_select(1, self._local(heads))  # [2, n * L * Hr, bs, w]
        src = src.view(2, n, self.layers, self.heads, self.bs, self.width)
        self._rows(rows).copy_(src.permute(1, 2, 0, 4, 3, 5))

    def scatter(self, rows: torch.Tensor, heads: np.ndarray, at: np.ndarray) -> None:
        """Rows ``[n, row_bytes]`` (on the device) into the blocks ``heads`` [n, LH]; ``at``
        [n]: each row's block index in its prompt."""
        ids = self._local(heads)
        src = self._rows(rows).permute(2, 0, 1, 4, 3, 5)  # [2, n, L, Hr, bs, w]
        self._kv().index_copy_(1, ids, src.reshape(2, -1, self.bs, self.width))
        span = torch.arange(self.bs, device=ids.device)
        slots = (ids[:, None] * self.bs + span).reshape(-1)  # [n * L * Hr * bs]
        first = self.ids.ship(np.repeat(at * self.bs, self.layers * self.heads))
        positions = (first[:, None] + span).reshape(-1)
        self.cache.positions.index_copy_(0, slots, positions.to(self.cache.positions.dtype))
        self.cache.scores.index_fill_(0, slots, 0.0)
