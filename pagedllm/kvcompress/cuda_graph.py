"""CUDA graphs for KV-Compress decode steps.

The graphs of ``worker/cuda_graph.py`` (one per batch size of the same ladder, one memory pool),
with the per-head layout's inputs: each layer attends over the cache's whole persistent tables
and lengths (``HeadPagedCache.tables`` / ``lens``, fixed addresses) through a row index per
query row, so a replay copies only B x (1 + 1 + LH + 1) integers: token id, position, the new
KV's slot in every (layer, head), and the request's table row. Padding rows read the cache's
``pad_row`` (every head empty: output 0, no score touched) and write their K/V into its
``spare_slot``. Lengths, positions and zeroed scores of the new KVs are set by
``HeadPagedCache.prepare_step`` before the replay, as in eager mode; the scores are added by
the decode kernel inside the graph.

Two sets of graphs when the model has compressible layers: one whose decode kernels add the
scores of the rows flagged ``scored``, and one built without the score pass, replayed when no
row of the step is scored (no request has a budget). A kernel that carries the score pass,
even one it skips for every row, makes decode steps slower (Benchmark A measures it,
benchmarks/README.md), and its best launch shape differs (``kvc_decode_tile_config``).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.kvcompress.attention import KVCStepPlan
from pagedllm.kvcompress.cache import HeadPagedCache
from pagedllm.worker.cuda_graph import CUDAGraphRunner, capture_sizes

logger = logging.getLogger(__name__)


class KVCGraphRunner(CUDAGraphRunner):
    """Captures ``model(input_ids, positions, metadata)`` of KV-Compress decode steps for each
    batch size and replays it (see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        cache: HeadPagedCache,
        max_bs: int,
        max_model_len: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.cache = cache
        self.sizes = capture_sizes(max_bs)
        self.max_bs = n = self.sizes[-1]
        self.block_size = cache.block_size
        self.max_model_len = max_model_len
        self.query_lens = (1,)  # decode steps only
        self.sizes_for = {1: self.sizes}
        self.input_ids = torch.zeros(n, dtype=torch.int32, device=device)
        self.positions = torch.zeros(n, dtype=torch.int32, device=device)
        self.slots = torch.full(
            (n, cache.num_heads), cache.spare_slot, dtype=torch.int64, device=device
        )  # [n, LH]
        self.rows = torch.full((n,), cache.pad_row, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.pool = None
        # scoring -> (graphs, outputs); the set being captured builds its metadata with it
        self.sets: dict[bool, tuple[dict, dict]] = {}
        self._scoring = True
        self.replays = {True: 0, False: 0}  # replays of each set (tests, benchmarks)

    def _metadata(self, bs: int, q: int) -> AttentionMetadata:
        assert q == 1
        cache = self.cache
        qsl = np.arange(bs + 1)
        md = AttentionMetadata(
            num_reqs=bs,
            num_actual_tokens=bs,
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=cache.lens,
            slot_mapping=self.slots[:bs, 0],
            block_tables=cache.tables,
            max_query_len=1,
            max_seq_len=self.max_model_len,  # graphs must cover any context length
            block_size=self.block_size,
            query_start_loc_np=qsl,
            seq_lens_np=np.full(bs, self.max_model_len),
        )
        plan = KVCStepPlan(
            decode=np.arange(bs),
            prefill=np.zeros(0, dtype=np.int64),
            collect=np.ones(bs, dtype=np.int64),
            maxpool_kernel=0,
            rows=np.full(bs, cache.pad_row),
            max_lens=np.full(bs, self.max_model_len),
        )
        rows = self.rows[:bs]
        md.groups = cache.layer_metadata(
            md, self.slots[:bs], self.positions[:bs], plan, rows, scoring=self._scoring
        )
        return md

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, with the score pass and (when any layer is compressible)
        without it, in one pool (the kernels' compilation happens in the warm-up runs)."""
        self.slots.fill_(self.cache.spare_slot)
        self.rows.fill_(self.cache.pad_row)
        for scoring in (True, False) if any(self.cache.spec.compressible) else (True,):
            self._scoring = scoring
            self.graphs, self.outputs = {}, {}
            super().capture()
            self.sets[scoring] = (self.graphs, self.outputs)

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        """Replay for a decode-only batch of ``md.num_reqs`` rows; returns [num_reqs, hidden]."""
        b = md.num_reqs
        bs = next(s for s in self.sizes if s >= b)
        slots, rows = md.plan["kvc"][:2]  # [b, LH], [b]
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(positions)
        self.slots[:b].copy_(slots)
        self.rows[:b].copy_(rows)
        if bs > b:  # padding rows: the empty row, K/V into the spare slot
            self.slots[b:bs].fill_(self.cache.spare_slot)
            self.rows[b:bs].fill_(self.cache.pad_row)
        plan: KVCStepPlan = md.plan["kvc"][3]
        scoring = len(self.sets) == 1 or self.cache.any_scored(plan.rows)
        graphs, outputs = self.sets[scoring]
        self.replays[scoring] += 1
        graphs[bs, 1].replay()
        return outputs[bs, 1][:b]
