"""The model runner's side of KV-Compress: the per-head paged cache, its per-row tables on the
device, each step's per-layer metadata, and eviction.

Tensors (``num_slots = num_blocks * block_size``; slot = block id * block_size + offset):
- ``kv`` [2, num_blocks, block_size, head_dim]: every layer and KV head shares the one pool;
- ``scores`` [num_slots] float32: attention received by each KV (``attention.py``);
- ``positions`` [num_slots] int32: the token position each slot holds (after compaction a
  head's logical order is not its positions' order: the protected window and the sinks are
  found by position).
Per request row, on the device: ``tables`` [rows, LH, max_blocks] int32 and ``lens`` [rows, LH]
int64 (KVs each head holds), LH = layers x KV heads, head ``lh = l * H + h``. The scheduler's
``HeadPagedKVCacheManager`` allocates; this class mirrors its tables from the deltas of each
``SchedulerOutput`` and runs the evictions the scheduler asks for, after the step's forward
pass (so their scores include the step's attention), returning the new lengths.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.config import KVCompressConfig
from pagedllm.core.kv_cache.head_paged import HeadBlocks, HeadTable
from pagedllm.core.kv_cache.spec import HeadPagedSpec, cdiv
from pagedllm.kvcompress.attention import KVCLayerInfo, KVCStepPlan
from pagedllm.kvcompress.evict import compact, plan_eviction


class HeadPagedCache:
    """The KV-Compress cache of one device (see the module docstring). It has the methods of
    ``KVCacheLayout`` the runner calls (allocate, bind, copy_blocks, swap, ...)."""

    def __init__(
        self,
        spec: HeadPagedSpec,
        kvc: KVCompressConfig,
        dtype: torch.dtype,
        device: torch.device,
        max_rows: int,
        max_model_len: int,
        windows: list[int | None],
    ) -> None:
        self.spec = spec
        self.kvc = kvc
        self.dtype = dtype
        self.device = device
        self.block_size = spec.block_size
        self.num_layers = spec.num_layers
        self.num_kv_heads = spec.num_kv_heads
        self.num_heads = spec.num_heads_total
        self.head_dim = spec.head_dim
        self.windows = windows
        self.compressible = torch.tensor(
            np.repeat(np.asarray(spec.compressible, dtype=bool), spec.num_kv_heads),
            device=device,
        )
        self.max_blocks = cdiv(max_model_len, self.block_size) + 1
        self.tables = torch.zeros(
            (max_rows, self.num_heads, self.max_blocks), dtype=torch.int32, device=device
        )
        self.lens = torch.zeros((max_rows, self.num_heads), dtype=torch.int64, device=device)
        self.num_blocks = 0
        self.kv = torch.empty(0)
        self.scores = torch.empty(0)
        self.positions = torch.empty(0)
        self.host: tuple[torch.Tensor, ...] = ()
        self.generator = torch.Generator(device=device).manual_seed(0)

    # ------------------------------------------------------------------- memory
    @property
    def block_bytes(self) -> int:
        """Bytes of one block: K and V of ``block_size`` tokens of one head, plus each slot's
        score (4 bytes) and position (4 bytes)."""
        return self.spec.page_bytes + 8 * self.block_size

    @property
    def bytes_per_token(self) -> float:
        return self.block_bytes * self.num_heads / self.block_size

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [self.kv] if self.num_blocks else []

    def _make(self, n: int, device: torch.device | str, pin: bool) -> tuple[torch.Tensor, ...]:
        bs, d = self.block_size, self.head_dim
        kv = torch.zeros(2, n, bs, d, dtype=self.dtype, device=device, pin_memory=pin)
        scores = torch.zeros(n * bs, dtype=torch.float32, device=device, pin_memory=pin)
        pos = torch.zeros(n * bs, dtype=torch.int32, device=device, pin_memory=pin)
        return kv, scores, pos

    def allocate(self, num_blocks: int) -> list[torch.Tensor]:
        self.num_blocks = num_blocks
        self.kv, self.scores, self.positions = self._make(num_blocks, self.device, False)
        return [self.kv]

    def allocate_host(self, num_blocks: int) -> None:
        pin = self.device.type == "cuda"
        self.host = self._make(num_blocks, "cpu", pin) if num_blocks > 0 else ()

    def release(self) -> None:
        self.num_blocks = 0
        self.kv = self.scores = self.positions = torch.empty(0)

    def bind(self, layers: list[torch.nn.Module]) -> None:
        """Layer i reads ``metadata.groups[i]`` (its own tables) and the one cache tensor."""
        for i, layer in enumerate(layers):
            layer.layer_idx = layer.kv_group = i
            layer.kv_cache = self.kv

    def _views(self, tensors: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        kv, scores, pos = tensors
        bs = self.block_size
        return [kv, scores.view(-1, bs), pos.view(-1, bs)]  # each indexed by block on dim -2/0

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Block src -> dst: K, V, scores and positions (a fork's copy-on-write)."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        kv, sc, pos = self._views((self.kv, self.scores, self.positions))
        kv.index_copy_(1, dst, kv.index_select(1, src))
        sc.index_copy_(0, dst, sc.index_select(0, src))
        pos.index_copy_(0, dst, pos.index_select(0, src))

    def swap(self, out_pairs: list[tuple[int, int]], in_pairs: list[tuple[int, int]]) -> None:
        """Device <-> host block copies (K, V, scores, positions)."""
        if not (out_pairs or in_pairs):
            return
        dev = self._views((self.kv, self.scores, self.positions))
        host = self._views(self.host)
        for pairs, to_host in ((out_pairs, True), (in_pairs, False)):
            if not pairs:
                continue
            a = torch.tensor([x for x, _ in pairs])
            b = torch.tensor([y for _, y in pairs])
            for i, (dv, hv) in enumerate(zip(dev, host)):
                dim = 1 if i == 0 else 0
                if to_host:
                    hv.index_copy_(dim, b, dv.index_select(dim, a.to(self.device)).cpu())
                else:
                    dv.index_copy_(dim, b.to(self.device), hv.index_select(dim, a).to(self.device))

    # ------------------------------------------------------------------- tables
    def set_row(self, row: int, head: HeadTable | None) -> None:
        """A (re)started request's whole table and computed lengths."""
        self.tables[row].zero_()
        if head is None:
            self.lens[row] = 0
            return
        n = head.table.shape[1]
        if n:
            self.tables[row, :, :n] = torch.from_numpy(head.table).to(self.device)
        self.lens[row] = torch.from_numpy(np.asarray(head.lens, dtype=np.int64)).to(self.device)

    def set_entries(self, row: int, blocks: HeadBlocks) -> None:
        """New (or copy-on-write replaced) entries of a row's table."""
        if len(blocks) == 0:
            return
        lh = torch.from_numpy(blocks.lh).to(self.device)
        index = torch.from_numpy(blocks.index).to(self.device)
        ids = torch.from_numpy(blocks.ids.astype(np.int32)).to(self.device)
        self.tables[row, lh, index] = ids

    # --------------------------------------------------------------------- step
    def prepare_step(
        self,
        md: AttentionMetadata,
        rows: np.ndarray,
        n_sched: np.ndarray,
        positions: torch.Tensor,  # [T] this step's token positions
        sampling: np.ndarray,  # [R] bool: the request samples this step (or is evicted
        # after it: a chunk that ends at its ``kvc_compress_at``)
    ) -> None:
        """Slots of the step's new KVs in every head, the per-layer metadata
        (``md.groups[l]``), and each new slot's position and zero score. Advances ``lens``.

        Example: H 1, a request with lens [5] (bs 4, table [3, 8]) scheduled 2 tokens ->
        logical 5, 6 -> slots 8*4+1, 8*4+2 = 33, 34; seq_lens [7]."""
        dev = self.device
        bs, lh = self.block_size, self.num_heads
        r = len(rows)
        cu = np.cumsum(n_sched)
        total = int(cu[-1])
        req_idx_np = np.repeat(np.arange(r), n_sched)
        offsets_np = np.arange(total) - np.repeat(cu - n_sched, n_sched)
        rows_t = torch.from_numpy(rows).to(dev)
        req_idx = torch.from_numpy(req_idx_np).to(dev)
        offsets = torch.from_numpy(offsets_np).to(dev)
        n_t = torch.from_numpy(n_sched).to(dev)
        width = min(self.max_blocks, cdiv(int(md.max_seq_len), bs) + 1)
        tables = self.tables[rows_t, :, :width]  # [R, LH, W]
        lens_before = self.lens[rows_t]  # [R, LH]
        idx = lens_before[req_idx] + offsets[:, None]  # [T, LH] logical index of each new KV
        head = torch.arange(lh, device=dev)
        blk = tables[req_idx[:, None], head[None, :], idx // bs].long()
        slots = blk * bs + idx % bs  # [T, LH]
        new_lens = lens_before + n_t[:, None]
        self.lens[rows_t] = new_lens
        flat = slots.reshape(-1)
        self.positions[flat] = positions.to(torch.int32)[:, None].expand(total, lh).reshape(-1)
        self.scores[flat] = 0.0
        # which of each request's last queries score the keys: a decode its one query, the
        # chunk that ends a prompt its last `window` queries, other prefill chunks none
        q_lens = n_sched
        w = self.kvc.prefill_metric_collection_window_size
        collect = np.where(q_lens == 1, 1, np.where(sampling, np.minimum(w, q_lens), 0))
        plan = KVCStepPlan(
            decode=np.nonzero(q_lens == 1)[0],
            prefill=np.nonzero(q_lens > 1)[0],
            collect=collect,
            maxpool_kernel=self.kvc.maxpool_kernel if self.kvc.maxpool_metrics else 0,
        )
        h = self.num_kv_heads
        comp = self.spec.compressible
        groups = []
        for layer in range(self.num_layers):
            part = slice(layer * h, (layer + 1) * h)
            m = md.with_tables(slots[:, part], tables[:, part])
            m.seq_lens = new_lens[:, part]
            m.kvc = KVCLayerInfo(self.scores, self.positions, positions, bool(comp[layer]), plan)
            groups.append(m)
        md.groups = groups

    # ----------------------------------------------------------------- eviction
    def compress(
        self,
        rows: np.ndarray,  # [B] rows to compress
        budgets: np.ndarray,  # [B] KVs each may keep in its compressible heads
        protect_from: np.ndarray,  # [B] positions >= this are never evicted
        max_len: int,  # a bound on every head's length (the requests' token counts)
    ) -> torch.Tensor:
        """Evict down to the budgets and compact; returns the new lengths [B, LH] (on the
        device) and updates ``lens``."""
        dev = self.device
        rows_t = torch.from_numpy(rows).to(dev)
        width = min(self.max_blocks, cdiv(max_len, self.block_size))
        tables = self.tables[rows_t, :, :width]
        lens = self.lens[rows_t]
        evict, order, slots, valid = plan_eviction(
            self.scores,
            self.positions,
            tables,
            lens,
            torch.from_numpy(budgets.astype(np.int64)).to(dev),
            torch.from_numpy(protect_from.astype(np.int64)).to(dev),
            self.compressible,
            max_len,
            self.block_size,
            self.kvc.num_sinks,
            self.kvc.method,
            self.generator,
        )
        kv = self.kv.view(2, -1, self.head_dim)
        new_lens = compact(kv, self.scores, self.positions, evict, order, slots, valid, lens)
        self.lens[rows_t] = new_lens
        return new_lens
