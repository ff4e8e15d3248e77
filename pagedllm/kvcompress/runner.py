"""KV-Compress, worker role: the per-head paged cache as the model runner's KV layout, the
rows' scoring flags, each step's per-head slots, and the evictions the planner
(``core/sched/kvc.py``) asks for, whose new lengths go back to it. With speculative decoding,
before a step's forward pass: the last step's rejected drafts' KVs leave, its verify rows'
queries of real tokens score the keys, and the evictions due after it run (the rules:
``core/sched/kvc.py``).

The model runner reaches this only through the layout hooks (``pagedllm/kv_layout.py``) and
the connector hooks (``pagedllm/worker/kv_connector.py``); it loads the class through the
connector registry (``core/sched/connector.py``), so the worker floor never imports this one.

Tensor parallelism: each rank holds its own KV heads in a pool of its own; the scheduler's
tables and block ids cover every rank's, and the hooks here translate them into this rank's
(``shard.py``). Evictions choose across every rank's heads, and the lengths that go back
are every rank's (rank 0's report reaches the scheduler).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from pagedllm.core.kv_cache.spec import HeadPagedSpec, KVCacheGroup, KVCacheGroups, cdiv
from pagedllm.core.sched.kvc import KVCEviction, KVCMetadata, KVCReport
from pagedllm.distributed.parallel_state import tp_info
from pagedllm.kvcompress.cache import HeadPagedCache
from pagedllm.kvcompress.evict import move_bound, stuck_bound, width_groups
from pagedllm.kvcompress.shard import HeadShard
from pagedllm.utils.pinned import copy_to_host
from pagedllm.worker.kv_connector import KVConnectorWorker, StepBatch

logger = logging.getLogger(__name__)


class KVCompressWorker(HeadPagedCache, KVConnectorWorker):
    """The KV-Compress cache of one device and its runner hooks (see the module docstring)."""

    name = "kvcompress"
    owns_layout = True

    # ------------------------------------------------------- before the caches exist
    @staticmethod
    def make_backend(device: torch.device) -> Any:
        """The per-head attention backend: Triton kernels on a GPU, torch ops on a CPU."""
        if device.type == "cuda":
            from pagedllm.kvcompress.triton_backend import KVCTritonBackend

            return KVCTritonBackend()
        from pagedllm.kvcompress.attention import KVCTorchBackend

        return KVCTorchBackend()

    @staticmethod
    def kv_groups(layers: list[torch.nn.Module], block_size: int, elem: int) -> KVCacheGroups:
        """One group of every layer, paged per KV head. Full-attention layers are
        compressible; sliding-window ones keep their KVs when the model has full-attention
        layers (Gemma 3), and are compressed when every layer has a window (Mistral v0.1):
        the kernels apply the window by each key's position. Under tensor parallelism the
        layers hold this rank's KV heads, and the spec counts the ranks (``num_ranks``)."""
        first = layers[0]
        if any(
            (a.num_kv_heads, a.head_dim) != (first.num_kv_heads, first.head_dim) for a in layers
        ):
            raise ValueError("KV-Compress needs the same KV heads and head size in every layer.")
        spec = HeadPagedSpec(
            block_size,
            first.num_kv_heads,
            first.head_dim,
            elem,
            num_layers=len(layers),
            compressible=tuple(
                not a.sliding_window or all(b.sliding_window for b in layers) for a in layers
            ),
            num_ranks=tp_info()[1],
        )
        return KVCacheGroups((KVCacheGroup(spec, tuple(range(len(layers)))),), 1, (spec,))

    @classmethod
    def for_runner(cls, runner: Any) -> KVCompressWorker:
        spec = runner.kv_groups.head_paged
        assert spec is not None
        worker = cls(
            spec,
            runner.config.kvc_config,
            runner.kv_dtype,  # the model's, or float8 e4m3 (kv_cache_dtype fp8)
            runner.device,
            runner.config.scheduler_config.max_num_seqs,
            runner.max_model_len,
            [a.sliding_window or None for a in runner.model.attention_layers()],
            HeadShard(*tp_info(), spec.num_layers, spec.num_kv_heads),
            runner.cache_config.calculate_kv_scales,
        )
        worker.batch = runner.input_batch
        return worker

    batch: Any = None  # the runner's InputBatch (request id -> row)
    profiler: Any = None  # a DeviceTimer (worker/profiler.py) that times evictions, if set
    # the step's work before its forward pass is done (``_before_step``), and the lengths of
    # its evictions there, until ``after_forward`` reports them
    _started = False
    _pre: tuple[list[str], torch.Tensor] | None = None

    # ------------------------------------------------------------- layout hooks
    def add_rows(self, batch: Any, new_reqs: list, so: Any = None) -> list[int]:
        """Rows for new requests: the input batch keeps no block table of theirs; their
        per-head tables, lengths and scoring flag (from the planner) go to ``set_row``."""
        meta = so.kv_connector_metadata.get(self.name) if so is not None else None
        scored = meta.scored if meta is not None else frozenset()
        rows = []
        for new in new_reqs:
            head = self.shard.table(new.block_ids[0]) if new.block_ids else None
            row = batch.add_request(replace(new, block_ids=()))
            self.set_row(row, head, new.req_id in scored)
            rows.append(row)
        return rows

    def update_rows(self, batch: Any, cached_rows: list[tuple]) -> None:
        """New (or copy-on-write replaced) per-head entries of every row, in one scatter
        (``set_entries``); tokens the scheduler appends and computed counts into the batch."""
        entry_rows: list[int] = []
        entries: list = []
        for req_id, new_block_ids, num_computed, replaced, append in cached_rows:
            row = batch.req_id_to_row[req_id]
            if replaced or new_block_ids:  # (most rows of a decode step have neither)
                for blocks in (*replaced, *new_block_ids):
                    entry_rows.append(row)
                    entries.append(self.shard.blocks(blocks))
            for token in append:
                batch.append_token(row, token)
            batch.num_computed_tokens[row] = num_computed
        if entries:
            self.set_entries(entry_rows, entries)

    def allocate(self, num_blocks: int) -> list[torch.Tensor]:
        self.shard.num_blocks = num_blocks
        return super().allocate(num_blocks)

    def allocate_host(self, num_blocks: int) -> None:
        self.shard.num_host_blocks = max(num_blocks, 0)
        super().allocate_host(num_blocks)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        super().copy_blocks(self.shard.block_pairs(pairs))

    def swap(self, out_pairs: list[tuple[int, int]], in_pairs: list[tuple[int, int]]) -> None:
        shard = self.shard
        super().swap(shard.swap_pairs(out_pairs, True), shard.swap_pairs(in_pairs, False))

    def blocks_per_request(self, max_model_len: int, max_num_tokens: int, max_blocks: int) -> int:
        """One block per (layer, KV head) per ``block_size`` tokens."""
        return self.num_heads * cdiv(max_model_len, self.block_size)

    def begin_dummy(
        self, inputs: Any, rows: np.ndarray, n_sched: np.ndarray, num_blocks: int
    ) -> None:
        """The profiling pass's rows get tables over the first blocks, every row scoring."""
        nb = cdiv(int(n_sched.max()), self.block_size)
        self.lens[torch.from_numpy(rows).to(self.device)] = 0
        self.tables[: len(rows), :, :nb] = torch.arange(nb, device=self.device) % num_blocks
        sampling = np.ones(len(rows), dtype=bool)
        self.prepare_step(inputs.metadata, rows, n_sched, inputs.positions, sampling)
        self.layer_groups(inputs.metadata)  # (never calibrates fp8 scales: not real tokens)

    def end_dummy(self, num_rows: int) -> None:
        self.lens[:num_rows] = 0
        self.tables[:num_rows] = 0

    def capture_graphs(self, runner: Any) -> bool:
        """Compile the prefill and decode kernels' variants (eagerly too), then capture the
        KV-Compress decode graphs unless every layer has a window that is compacted (Mistral
        v0.1: the window is found by position in torch, with shapes that vary per step)."""
        if self.num_blocks:
            from pagedllm.kv_layout import warm_up_prefill_kernels
            from pagedllm.kvcompress.triton_backend import warm_up_decode_kernels

            warm_up_prefill_kernels(runner, self.num_blocks, self.dtype)

            warm_up_decode_kernels(
                self,
                runner.model.attention_layers()[0].num_heads,
                runner.model_config.torch_dtype,
                runner.input_batch.max_num_reqs,
            )
        if runner.config.device_config.enforce_eager:
            return True
        if any(w is not None and c for w, c in zip(self.windows, self.spec.compressible)):
            logger.info("KV-Compress runs eagerly on this model (compacted window layers)")
            return True
        from pagedllm.kvcompress.cuda_graph import KVCGraphRunner

        runner.graph_runner = KVCGraphRunner(
            runner.model, self, runner.input_batch.max_num_reqs, runner.max_model_len,
            runner.device,
        )  # fmt: skip
        runner.graph_runner.capture()
        return True

    # ---------------------------------------------------------- connector hooks
    def before_forward(self, so: Any, metadata: KVCMetadata | None, batch: StepBatch) -> None:
        """The last step's speculative work (``_before_step``), then the step's per-head
        slots: which rows score keys with their last queries (those that sample, and those
        the planner names), which verify drafts, then ``prepare_step``."""
        self._before_step(metadata)
        sampling = np.zeros(len(batch.rows), dtype=bool)
        sampling[batch.sample_idx] = True
        if metadata is not None and metadata.window:
            for i, rid in enumerate(so.num_scheduled_tokens):
                sampling[i] |= rid in metadata.window
        verify, ids = None, None
        spec = so.scheduled_spec_tokens
        if spec:
            ids = list(so.num_scheduled_tokens)
            verify = np.fromiter((rid in spec for rid in ids), dtype=bool, count=len(ids))
        self.prepare_step(
            batch.metadata, batch.rows, batch.n_sched, batch.positions, sampling, verify, ids
        )

    def _before_step(self, metadata: KVCMetadata | None) -> None:
        """Before the step's forward pass (the rules: ``core/sched/kvc.py``): the last step's
        rejected drafts' KVs leave every head, its verify rows' queries of real tokens score
        the keys, then the evictions due after it run (their lengths are reported with this
        step's). The last step's kept queries are dropped after this."""
        self._started = True
        stash, self.stash = self.stash, None
        self._pre = None
        if metadata is None:
            return
        rows_of = self.batch.req_id_to_row
        trims = [(rows_of[r], n) for r, n in metadata.trims.items() if r in rows_of]
        if trims:
            rows, num = zip(*trims)
            self.drop_tails(np.array(rows, dtype=np.int64), np.array(num, dtype=np.int64))
        if stash is not None and metadata.verified:
            with torch.inference_mode():
                self.score_verified(stash, metadata.verified, rows_of)
        if metadata.pre_evictions:
            self._pre = self._evict(metadata.pre_evictions)

    def after_forward(self, so: Any, metadata: KVCMetadata | None) -> Any:
        """Run the evictions the planner asked for (after the step's forward pass: its scores
        count); returns (request ids, their new lengths [B, LH], the same of the evictions
        before the forward pass; on the host once the event is done, the event or None). No
        host sync. A step with no forward pass does its ``_before_step`` work here."""
        if not self._started:
            self._before_step(metadata)
        self._started = False
        pre, self._pre = self._pre, None
        post = self._evict(metadata.evictions) if metadata and metadata.evictions else None
        if pre is None and post is None:
            return None
        empty: tuple[list[str], torch.Tensor] = ([], self.lens[:0])
        (pre_ids, pre_lens), (ids, lens) = pre or empty, post or empty
        (pre_host, host), done = copy_to_host([pre_lens, lens])
        return ids, host, pre_ids, pre_host, done

    def _evict(self, evictions: list[KVCEviction]) -> tuple[list[str], torch.Tensor]:
        """Run evictions; returns (their request ids, their new lengths [B, LH] on the
        device)."""
        rows_of = self.batch.req_id_to_row
        bs, method = self.block_size, self.kvc.method
        ids: list[str] = []
        parts: list[torch.Tensor] = []
        timer = self.profiler.begin() if self.profiler is not None else None
        # one call per group of similar longest heads (``width_groups``): each call sorts
        # every member's heads to the group's longest
        for group in width_groups([e.max_head_len for e in evictions]):
            plan = [evictions[i] for i in group]
            ids += [e.req_id for e in plan]
            rows = np.array([rows_of[e.req_id] for e in plan], dtype=np.int64)
            budgets = np.array([e.budget for e in plan], dtype=np.int64)
            protect = np.array([e.protect_from for e in plan], dtype=np.int64)
            keep = np.array([e.keep_below for e in plan], dtype=np.int64)
            copies = [
                (row, *self.shard.copies(e.copy_to, e.copy_src))
                for row, e in zip(rows, plan)
                if e.copy_to
            ]
            max_len = max(e.max_head_len for e in plan)
            max_moves = sum(
                move_bound(e.held, e.budget, bs, method, self._stuck(e) if e.computed else None)
                for e in plan
            )
            with torch.inference_mode():
                parts.append(
                    self.compress(
                        rows, budgets, protect, keep, max(max_len, 1), max(max_moves, 1), copies
                    )
                )
        lens = parts[0] if len(parts) == 1 else torch.cat(parts)
        if timer is not None:
            self.profiler.add_span("kvc_evict", self.profiler.end(timer))
        return ids, lens

    def finish(self, pending: Any) -> KVCReport | None:
        """Each evicted request's computed KVs left per (layer, KV head) [LH]."""
        if pending is None:
            return None
        ids, lens, pre_ids, pre_lens, done = pending
        if done is not None:
            done.synchronize()
        return KVCReport(dict(zip(ids, lens.numpy())), dict(zip(pre_ids, pre_lens.numpy())))

    def _stuck(self, e: KVCEviction) -> int:
        """``stuck_bound`` of an eviction: its compressible heads' unevictable KVs (the
        protected window, the sinks or shared prefix) plus a block each, at most."""
        sinks = max(e.keep_below, self.kvc.num_sinks)
        heads = self.num_compressible_heads
        return stuck_bound(heads, e.computed, e.protect_from, sinks, self.block_size)
