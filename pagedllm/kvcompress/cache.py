"""The model runner's side of KV-Compress: the per-head paged cache, its per-row tables on the
device, each step's per-layer metadata, and eviction.

Tensors (``num_slots = num_blocks * block_size``; slot = block id * block_size + offset):
- ``kv`` [2, num_blocks, block_size, head_dim]: every layer and KV head shares the one pool;
- ``scores`` [num_slots] float32: attention received by each KV (``attention.py``);
- ``positions`` [num_slots] int32: the token position each slot holds (after compaction a
  head's logical order is not its positions' order: the protected window and the sinks are
  found by position).
Per request row, on the device: ``tables`` [rows + 1, LH, max_blocks] int32 and ``lens``
[rows + 1, LH] int64 (KVs each head holds), LH = layers x KV heads, head ``lh = l * H + h``;
the last row (``pad_row``) never holds anything (CUDA-graph padding rows read it). The
scheduler's ``HeadPagedKVCacheManager`` allocates; this class mirrors its tables from the
deltas of each ``SchedulerOutput`` and runs the evictions the scheduler asks for, after the
step's forward pass (so their scores include the step's attention), returning the new lengths.
Layers attend over the whole persistent tables through each request's row (no per-step
gather of tables), so a CUDA graph captures their addresses once.

One block more than the manager hands out is allocated: its first slot (``spare_slot``) takes
the K/V of padding rows and the unused entries of a compaction's move list.

No host sync: each step's host arrays go to the device in one pinned, non-blocking copy, and
eviction takes its bounds (sort width, moves) from the scheduler.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.config import KVCompressConfig
from pagedllm.core.kv_cache.head_paged import HeadBlocks, HeadTable
from pagedllm.core.kv_cache.spec import HeadPagedSpec, cdiv
from pagedllm.kv_layout import KVScales, as_bytes
from pagedllm.kvcompress.attention import (
    KVCLayerInfo,
    KVCStepPlan,
    VerifyQueries,
    prefill_window_scores_batched,
)
from pagedllm.kvcompress.evict import compact, plan_eviction
from pagedllm.kvcompress.shard import HeadShard
from pagedllm.utils.pinned import PinnedRing

_NO_ENTRIES = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))  # (nobody writes them)


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
        shard: HeadShard | None = None,
        calculate_scales: bool = False,
    ) -> None:
        self.spec = spec
        # this rank's share of the heads (tensor parallelism; one rank: all of them)
        self.shard = shard or HeadShard(0, 1, spec.num_layers, spec.num_kv_heads)
        self.kvc = kvc
        self.dtype = dtype  # torch.float8_e4m3fn for an fp8 cache
        self.device = device
        # an fp8 cache's scales per layer and KV head (kv_layout.KVScales: the same rules)
        self.kv_scales = KVScales(dtype, device, calculate_scales)
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
        self.num_compressible_heads = int(sum(spec.compressible)) * spec.num_kv_heads
        self.max_blocks = cdiv(max_model_len, self.block_size) + 1
        self.pad_row = max_rows
        self.tables = torch.zeros(
            (max_rows + 1, self.num_heads, self.max_blocks), dtype=torch.int32, device=device
        )
        self.lens = torch.zeros((max_rows + 1, self.num_heads), dtype=torch.int64, device=device)
        # 1 where the row's request may be evicted (it has a budget): only those are scored
        self.scored = torch.zeros(max_rows + 1, dtype=torch.int32, device=device)
        self.scored_np = np.zeros(max_rows + 1, dtype=bool)
        # the last step's verify rows' queries, until the next step scores them
        self.stash: VerifyQueries | None = None
        self.num_blocks = 0
        self.spare_slot = 0
        self.kv = torch.empty(0)
        self.scores = torch.empty(0)
        self.positions = torch.empty(0)
        self.host: tuple[torch.Tensor, ...] = ()
        self.generator = torch.Generator(device=device).manual_seed(0)
        self._arange = np.arange(max_rows, dtype=np.int64)  # (shared: nobody writes them)
        self._zeros = np.zeros(max_rows, dtype=np.int64)
        # table entries set since the last step, not yet on the device (``set_entries``)
        self._entries: list[tuple[np.ndarray, np.ndarray]] = []
        # host arrays reach the device through a ring of pinned buffers (``ship``)
        self._ring = PinnedRing(device, 1 << 16, n=8)
        # a step's slots: two Triton launches on a GPU (a dozen PyTorch kernels otherwise)
        self._step_slots = step_slots_torch
        if device.type == "cuda":
            from pagedllm.ops.kvc_step import kvc_step_slots

            self._step_slots = kvc_step_slots

    # ------------------------------------------------------------------- memory
    @property
    def block_bytes(self) -> int:
        """Bytes of one block: K and V of ``block_size`` tokens of one head, plus each slot's
        score (4 bytes) and position (4 bytes)."""
        return self.spec.page_bytes + 8 * self.block_size

    @property
    def bytes_per_token(self) -> float:
        return self.block_bytes * self.num_heads / self.block_size

    def metadata_bytes_per_kv(self) -> float:
        """Bytes beside each KV's K and V: its score (4) and position (4), and its share of
        a table entry (4 bytes per block of ``block_size`` KVs). Example: bs 16 -> 8.25."""
        return 8 + 4 / self.block_size

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
        self.kv, self.scores, self.positions = self._make(num_blocks + 1, self.device, False)
        self.spare_slot = num_blocks * self.block_size  # the extra block's first slot
        return [self.kv]

    def allocate_host(self, num_blocks: int) -> None:
        pin = self.device.type == "cuda"
        self.host = self._make(num_blocks, "cpu", pin) if num_blocks > 0 else ()

    def release(self) -> None:
        self.num_blocks = 0
        self.kv = self.scores = self.positions = torch.empty(0)

    def bind(self, layers: list[torch.nn.Module]) -> None:
        """Layer i reads ``metadata.groups[i]`` (its own tables) and the one cache tensor;
        with an fp8 cache its scales (``kv_scale`` [2, its KV heads])."""
        self.kv_scales.bind(layers)
        for i, layer in enumerate(layers):
            layer.layer_idx = layer.kv_group = i
            layer.kv_cache = self.kv

    def _views(self, tensors: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        kv, scores, pos = tensors
        bs = self.block_size
        # each indexed by block on dim -2/0 (an fp8 cache as bytes: no float8 index_copy_ on CPUs)
        return [as_bytes(kv), scores.view(-1, bs), pos.view(-1, bs)]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Block src -> dst: K, V, scores and positions (a fork's copy-on-write)."""
        if not pairs:
            return
        src, dst = self.ship(np.array([s for s, _ in pairs]), np.array([d for _, d in pairs]))
        self._copy_ids(src, dst)

    def _copy_ids(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Blocks ``src`` -> ``dst`` (device id tensors): K, V, scores and positions."""
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
    def ship(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        """int64 copies of host arrays on the device, in one copy through a pinned buffer
        (``PinnedRing``: non-blocking, no pinned allocation per copy), so the host never
        waits for the device here."""
        flat = np.concatenate([np.asarray(a, dtype=np.int64).reshape(-1) for a in arrays])
        t = self._ring.ship(flat)
        return list(t.split([np.asarray(a).size for a in arrays]))

    def set_row(self, row: int, head: HeadTable | None, scored: bool = True) -> None:
        """A (re)started request's whole table and computed lengths, and whether its KVs are
        scored (False: it has no budget, never evicted, so no score pass)."""
        self.flush_entries()  # (entries of an earlier request in the row must land first)
        self.scored_np[row] = scored
        self.tables[row].zero_()
        # (a Python scalar written into a device tensor would be a blocking copy)
        table = head.table if head is not None else np.zeros((self.num_heads, 0), np.int32)
        lens = np.asarray(head.lens) if head is not None else np.zeros(self.num_heads)
        table_t, lens_t, flag = self.ship(table, lens, np.array([int(scored)]))
        n = table.shape[1]
        if n:
            self.tables[row, :, :n] = table_t.view(self.num_heads, n).to(torch.int32)
        self.lens[row] = lens_t
        self.scored[row : row + 1] = flag

    def set_entries(self, rows: list[int], blocks: list[HeadBlocks]) -> None:
        """New (or copy-on-write replaced) table entries of several rows. They reach the
        device with the next step: ``prepare_step`` sends them in its one copy and its slot
        kernel writes them before it reads the tables (``flush_entries`` writes them at once,
        for a use of the tables without a step).

        Example: max_blocks 5, LH 2; row 3 gets block 9 at index 1 of head 1 -> flat index
        (3 * 2 + 1) * 5 + 1 = 36."""
        parts = [(r, b) for r, b in zip(rows, blocks) if len(b)]
        if not parts:
            return
        row = np.repeat(np.array([r for r, _ in parts], dtype=np.int64), [len(b) for _, b in parts])
        lh = np.concatenate([b.lh for _, b in parts])
        index = np.concatenate([b.index for _, b in parts])
        flat = (row * self.num_heads + lh) * self.max_blocks + index
        self._entries.append((flat, np.concatenate([b.ids for _, b in parts])))

    def _take_entries(self) -> tuple[np.ndarray, np.ndarray]:
        """The table entries set since the last step: (flat indices, block ids), int64."""
        if not self._entries:
            return _NO_ENTRIES
        parts, self._entries = self._entries, []
        if len(parts) == 1:
            return parts[0]
        return np.concatenate([f for f, _ in parts]), np.concatenate([i for _, i in parts])

    def flush_entries(self) -> None:
        """Write the pending table entries now (one scatter)."""
        flat, ids = self._take_entries()
        if len(flat):
            flat_t, ids_t = self.ship(flat, ids)
            self.tables.view(-1).index_copy_(0, flat_t, ids_t.to(torch.int32))

    # --------------------------------------------------------------------- step
    def prepare_step(
        self,
        md: AttentionMetadata,
        rows: np.ndarray,
        n_sched: np.ndarray,
        positions: torch.Tensor,  # [T] this step's token positions
        sampling: np.ndarray,  # [R] bool: the request's last queries score keys (it samples
        # this step, or the planner names its chunk: ``KVCMetadata.window``)
        verify: np.ndarray | None = None,  # [R] bool: the row verifies draft tokens
        req_ids: list[str] | None = None,  # [R] (with ``verify``)
    ) -> None:
        """Slots of the step's new KVs in every head, and each new slot's position and zero
        score; advances ``lens``. ``md.plan["kvc"]`` keeps (slots [T, LH], the requests' table
        rows, positions, the step plan): a CUDA graph copies the first two into its buffers,
        ``finish_metadata`` makes the per-layer metadata of an eager pass from all four.
        A verify row scores nothing this step; the compressible layers keep its queries when
        it is scored (``VerifyQueries``, ``self.stash``: ``score_verified`` at the next step).

        Example: H 1, a request with lens [5] (bs 4, table [3, 8]) scheduled 2 tokens ->
        logical 5, 6 -> slots 8*4+1, 8*4+2 = 33, 34; its lens become [7]."""
        bs = self.block_size
        r = len(rows)
        total = int(md.num_actual_tokens)
        collect_scored = self.scored_np[rows]  # requests that are never evicted collect nothing
        if total == r:  # a decode step (every request one token): the arrays at once
            ar = self._arange[:r]
            req_idx_np, offsets_np, decode = ar, self._zeros[:r], ar
            prefill = self._zeros[:0]
            collect = collect_scored.astype(np.int64)
        else:
            cu = np.cumsum(n_sched)
            req_idx_np = np.repeat(np.arange(r), n_sched)
            offsets_np = np.arange(total) - np.repeat(cu - n_sched, n_sched)
            # which of each request's last queries score the keys: a decode its one query,
            # the chunk that ends a prompt its last `window` queries, other prefill chunks none
            w = self.kvc.prefill_metric_collection_window_size
            collect = np.where(n_sched == 1, 1, np.where(sampling, np.minimum(w, n_sched), 0))
            if verify is not None:
                collect[verify] = 0  # scored at the next step (``score_verified``)
            collect *= collect_scored
            decode, prefill = np.nonzero(n_sched == 1)[0], np.nonzero(n_sched > 1)[0]
        assert md.seq_lens_np is not None
        flat, ids = self._take_entries()  # the new table entries travel in the same copy
        rows_t, req_idx, offsets, n_t, flat_t, ids_t = self.ship(
            rows, req_idx_np, offsets_np, n_sched, flat, ids
        )
        win = prefill[collect[prefill] > 0]
        # the plan's index tensors are made by ``finish_metadata``, for an eager pass only (a
        # CUDA-graph replay of a decode step reads none of them)
        plan = KVCStepPlan(
            decode=decode,
            prefill=prefill,
            collect=collect,
            maxpool_kernel=self.kvc.maxpool_kernel if self.kvc.maxpool_metrics else 0,
            rows=rows,
            max_lens=md.seq_lens_np,
            prefill_max_q=int(n_sched[prefill].max()) if len(prefill) else 0,
            window_max_len=int(md.seq_lens_np[win].max()) if len(win) else 0,
            prefill_tokens=int(n_sched[prefill].sum()) if len(prefill) else 0,
            stash=self._stash_of(verify, collect_scored, n_sched, md.seq_lens_np, req_ids),
        )
        self.stash = plan.stash
        # [T, LH] slots (after writing the new table entries); positions and zero scores
        # written there, lens advanced
        slots = self._step_slots(
            self.tables, self.lens, rows_t, req_idx, offsets, n_t, positions, self.positions,
            self.scores, bs, flat_t, ids_t,
        )  # fmt: skip
        md.plan["kvc"] = (slots, rows_t, positions, plan)

    def _stash_of(
        self,
        verify: np.ndarray | None,  # [R] bool
        scored: np.ndarray,  # [R] bool
        n_sched: np.ndarray,  # [R]
        max_lens: np.ndarray,  # [R]
        req_ids: list[str] | None,
    ) -> VerifyQueries | None:
        """The verify rows whose queries the layers keep: those of scored requests (None
        when there is none, or no layer is compressible)."""
        if verify is None or not self.num_compressible_heads:
            return None
        keep = np.nonzero(verify & scored)[0]
        if not len(keep):
            return None
        assert req_ids is not None
        count = n_sched[keep]
        first = np.cumsum(n_sched)[keep] - count  # each kept row's first query row
        start = np.cumsum(count) - count
        rows = np.repeat(first - start, count) + np.arange(int(count.sum()))
        return VerifyQueries(
            [req_ids[i] for i in keep.tolist()], start, count, max_lens[keep].copy(), rows
        )

    def finish_metadata(self, md: AttentionMetadata) -> None:
        """Give each layer its metadata (``md.groups``) for an eager forward pass of the step
        ``prepare_step`` planned (a CUDA-graph replay needs none: it has its own); the first
        with real tokens calibrates an fp8 cache's scales where ``calculate_kv_scales`` asks."""
        self.kv_scales.finish_metadata(md)
        self.layer_groups(md)

    def layer_groups(self, md: AttentionMetadata) -> None:
        """``finish_metadata`` without the calibration: each layer's metadata only. The
        profiling pass uses it: its tokens are not real, and scales calibrated on them would
        stay and clamp real keys."""
        if md.groups is None:
            slots, rows_t, positions, plan = md.plan["kvc"]
            if not plan.tensors:  # the step's index tensors, shared by every layer
                qsl = md.query_start_loc_np
                assert qsl is not None
                index = KVCStepPlan.index_arrays(
                    plan.decode, plan.prefill, qsl, plan.rows, plan.collect
                )
                if plan.stash is not None:
                    index["stash_rows"] = plan.stash.rows
                shipped = self.ship(*index.values())
                plan.tensors = {k: t.view(a.shape) for (k, a), t in zip(index.items(), shipped)}
            md.groups = self.layer_metadata(
                md, slots, positions, plan, rows_t, self.any_scored(plan.rows)
            )

    def any_scored(self, rows: np.ndarray) -> bool:
        """Whether any of a step's table rows is scored; if none is, the step's kernels are
        built without the score pass (``layer_metadata``'s ``scoring``)."""
        return bool(self.scored_np[rows].any())

    def layer_metadata(
        self,
        md: AttentionMetadata,
        slots: torch.Tensor,  # [T, LH]
        positions: torch.Tensor,  # [T]
        plan: KVCStepPlan,
        rows_t: torch.Tensor,  # [R]
        scoring: bool = True,
    ) -> list[AttentionMetadata]:
        """Layer l's metadata: its heads' slots and its views of the whole tables/lengths.

        ``scoring`` False: no row of the step is scored (none has a budget, so none was ever
        evicted either): every layer reads as not compressible, its kernels built without the
        score pass."""
        h = self.num_kv_heads
        comp = self.spec.compressible if scoring else (False,) * self.num_layers
        groups = []
        for layer in range(self.num_layers):
            part = slice(layer * h, (layer + 1) * h)
            m = md.with_tables(slots[:, part], self.tables[:, part])
            m.seq_lens = self.lens[:, part]
            m.kvc = KVCLayerInfo(
                self.scores, self.positions, positions, bool(comp[layer]), plan, rows_t,
                self.scored, layer,
            )  # fmt: skip
            groups.append(m)
        return groups

    # ------------------------------------------------- speculative decoding
    def drop_tails(self, rows: np.ndarray, num: np.ndarray) -> None:
        """Rows' last ``num[i]`` KVs leave every head (rejected draft tokens: the last KVs of
        each head since their step, ``HeadPagedKVCacheManager.drop_last``). Their slots were
        never scored (a verify row scores at the next step) and get a new position and a zero
        score when reused."""
        rows_t, num_t = self.ship(rows, num)
        self.lens[rows_t] -= num_t[:, None]

    def score_verified(
        self, stash: VerifyQueries, verified: dict[str, int], rows_of: dict[str, int]
    ) -> None:
        """Score the keys with the first ``verified[r]`` queries of each kept verify row (its
        last known token's and its accepted drafts': ``core/sched/kvc.py``), after the
        rejected drafts' KVs left (``drop_tails``): they are the last ``verified[r]`` keys of
        every head, and query i of them saw its head's keys up to its own, as a decode query
        does. Squared probabilities summed over the queries and the query heads sharing a KV
        head, no max-pool (the decode rule). No host sync.

        Example: a row of 1 + 4 queries with 1 draft accepted, lens [12] after the drop ->
        queries 0 and 1 (logical 10 and 11) score the keys up to 10 and 11."""
        sel = [w for w, rid in enumerate(stash.req_ids) if rid in verified and rid in rows_of]
        if not sel or not stash.q:
            return
        w = np.asarray(sel)
        n = np.minimum([verified[stash.req_ids[i]] for i in sel], stash.count[w])
        c = int(n.max())
        i = np.arange(c)
        mask = i[None, :] < n[:, None]  # [W, C]
        q_rows = np.where(mask, stash.start[w][:, None] + i[None, :], 0)
        table_rows = np.array([rows_of[stash.req_ids[j]] for j in sel], dtype=np.int64)
        max_len = int(stash.max_lens[w].max())
        rows_t, q_rows_t, mask_t, n_t = self.ship(table_rows, q_rows, mask, n)
        q_rows_t = q_rows_t.view(len(sel), c)
        h, bs = self.num_kv_heads, self.block_size
        k_flat = self.kv[0].view(-1, self.head_dim)
        for layer, q in stash.q.items():
            part = slice(layer * h, (layer + 1) * h)
            tables, lens = self.tables[:, part], self.lens[:, part]
            lse, scale = stash.lse[layer], stash.scale[layer]
            if lse is not None:  # the GPU kernels' normalizers: one pass over the keys
                from pagedllm.ops.kvc_attention import kvc_window_scores

                kvc_window_scores(
                    q, self.kv, lse, tables, lens, rows_t, q_rows_t, n_t, scale,
                    self.scores, 0, max_len,
                )  # fmt: skip
            else:
                prefill_window_scores_batched(
                    q, k_flat, tables[rows_t], lens[rows_t], q_rows_t,
                    mask_t.view(len(sel), c).bool(), bs, scale, self.scores, 0, max_len,
                    window=stash.window[layer], positions=self.positions,
                    k_scale=stash.k_scale.get(layer),
                )  # fmt: skip

    # ----------------------------------------------------------------- eviction
    def compress(
        self,
        rows: np.ndarray,  # [B] rows to compress
        budgets: np.ndarray,  # [B] KVs each may keep in its compressible heads
        protect_from: np.ndarray,  # [B] positions >= this are never evicted
        keep_below: np.ndarray,  # [B] positions < this are never evicted (a shared prefix)
        max_len: int,  # a bound on every head's length
        max_moves: int,  # a bound on the KVs compaction moves (evict.move_bound, summed)
        copies: list[tuple[int, HeadBlocks, np.ndarray]] = (),  # (row, new entries, src ids)
    ) -> torch.Tensor:
        """Evict down to the budgets and compact; returns the new lengths [B, LH] (on the
        device) and updates ``lens``. First, ``copies``: rows whose cached prompt blocks stay
        in the prefix cache move to copies of them (content, then table entries). No host
        sync.

        Tensor parallelism: the budgets are every rank's, the chunks are chosen across every
        rank's heads (``plan_eviction``'s ``shard``), and the lengths returned are every
        rank's heads' (global head order), gathered over the group."""
        self.flush_entries()
        if copies:
            src, dst = self.ship(
                np.concatenate([s for _, _, s in copies]),
                np.concatenate([b.ids for _, b, _ in copies]),
            )
            self._copy_ids(src, dst)
            self.set_entries([r for r, _, _ in copies], [b for _, b, _ in copies])
            self.flush_entries()
        sinks = np.maximum(np.asarray(keep_below, dtype=np.int64), self.kvc.num_sinks)
        rows_t, budgets_t, protect_t, sinks_t = self.ship(rows, budgets, protect_from, sinks)
        width = min(self.max_blocks, cdiv(max_len, self.block_size))
        tables = self.tables[rows_t, :, :width]
        lens = self.lens[rows_t]
        evict, order, slots, valid = plan_eviction(
            self.scores,
            self.positions,
            tables,
            lens,
            budgets_t,
            protect_t,
            self.compressible,
            max_len,
            self.block_size,
            sinks_t,
            self.kvc.method,
            self.generator,
            self.shard,
            self.kvc.head_floor,
        )
        kv = self.kv.view(2, -1, self.head_dim)
        new_lens = compact(
            kv, self.scores, self.positions, evict, order, slots, valid, lens,
            max_moves, self.spare_slot,
        )  # fmt: skip
        self.lens[rows_t] = new_lens
        return self.shard.gather(new_lens)


def step_slots_torch(
    tables: torch.Tensor,
    lens: torch.Tensor,
    rows: torch.Tensor,
    req_idx: torch.Tensor,
    offsets: torch.Tensor,
    n_sched: torch.Tensor,
    token_positions: torch.Tensor,
    positions: torch.Tensor,
    scores: torch.Tensor,
    block_size: int,
    entry_index: torch.Tensor | None = None,
    entry_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """A step's new slots [T, LH] in PyTorch ops, after the step's new table entries (block
    ``entry_ids[i]`` at flat index ``entry_index[i]`` of ``tables``): token t of request
    ``req_idx[t]`` (table row ``rows[req_idx[t]]``, its ``offsets[t]``-th token this step)
    takes logical index ``lens[row, lh] + offset`` in every head ``lh``; the slot's position
    becomes the token's and its score 0, and ``lens`` of each row advances by its
    ``n_sched``. The CPU path, and the reference of the Triton version
    (``pagedllm/ops/kvc_step.py``, whose docstring has an example)."""
    bs, num_heads = block_size, tables.shape[1]
    total = req_idx.shape[0]
    if entry_index is not None and entry_index.numel():
        tables.view(-1).index_copy_(0, entry_index, entry_ids.to(tables.dtype))
    lens_before = lens[rows]  # [R, LH]
    idx = lens_before[req_idx] + offsets[:, None]  # [T, LH] logical index of each new KV
    head = torch.arange(num_heads, device=tables.device)
    blk = tables[rows[req_idx][:, None], head[None, :], idx // bs].long()
    slots = blk * bs + idx % bs  # [T, LH]
    lens[rows] = lens_before + n_sched[:, None]
    flat = slots.reshape(-1)
    positions[flat] = token_positions.to(torch.int32)[:, None].expand(total, num_heads).reshape(-1)
    scores.index_fill_(0, flat, 0.0)
    return slots
