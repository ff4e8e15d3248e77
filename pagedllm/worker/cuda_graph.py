"""CUDA graphs for decode-only steps.

One graph per batch size of a ladder (1, 2, 4, 8, 16, 24, 32, ... up to max_num_seqs), captured
largest first into one shared memory pool. A decode step of B requests replays the graph of the
smallest captured size >= B; the padded rows have slot -1 (their K/V are never written) and a
one-token context, so they cost a little compute and touch nothing.
"""

from __future__ import annotations

import logging

import torch

from pagedllm.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """[1, 2, 4, 8, 16, 24, 32, 40, ...] up to max_num_seqs (capped at 512)."""
    top = min(max_num_seqs, 512)
    sizes = [s for s in (1, 2, 4, 8) if s <= top] + list(range(16, top + 1, 8))
    if top not in sizes:
        sizes.append(top)
    return sizes


class CUDAGraphRunner:
    """Captures ``model(input_ids, positions, metadata)`` for each size and replays it."""

    def __init__(
        self,
        model: torch.nn.Module,
        max_bs: int,
        max_blocks_per_req: int,
        block_size: int,
        max_model_len: int,
        device: torch.device,
        num_kv_groups: int = 1,
    ) -> None:
        self.model = model
        self.sizes = capture_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        self.block_size = block_size
        self.max_model_len = max_model_len
        n = self.max_bs
        self.input_ids = torch.zeros(n, dtype=torch.int32, device=device)
        self.positions = torch.zeros(n, dtype=torch.int32, device=device)
        g = num_kv_groups  # slots and block tables per KV-cache group
        self.slot_mapping = torch.full((g, n), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(g, n, max_blocks_per_req, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def _metadata(self, bs: int) -> AttentionMetadata:
        md = AttentionMetadata(
            num_reqs=bs,
            num_actual_tokens=bs,
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            slot_mapping=self.slot_mapping[0, :bs],
            block_tables=self.block_tables[0, :bs],
            max_query_len=1,
            max_seq_len=self.max_model_len,  # graphs must cover any context length
            block_size=self.block_size,
        )
        if self.slot_mapping.shape[0] > 1:
            md.set_groups(self.slot_mapping[:, :bs], self.block_tables[:, :bs])
        return md

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, sharing one memory pool."""
        for bs in reversed(self.sizes):
            md = self._metadata(bs)
            args = (self.input_ids[:bs], self.positions[:bs], md)
            self.model(*args)  # warm up (Triton autotuning, lazy init) outside the graph
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                out = self.model(*args)
            if self.pool is None:
                self.pool = g.pool()
            self.graphs[bs] = g
            self.outputs[bs] = out
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s", self.sizes)

    def can_run(self, num_reqs: int) -> bool:
        """Whether a decode batch of this size has a captured graph."""
        return bool(self.graphs) and num_reqs <= self.max_bs

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        """Replay for a decode-only batch of ``md.num_reqs`` rows; returns [num_reqs, hidden]."""
        b = md.num_reqs
        bs = next(s for s in self.sizes if s >= b)
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(positions)
        self.seq_lens[:b].copy_(md.seq_lens)
        nb = md.block_tables.shape[1]
        # [G, b] slots and [G, b, nb] tables (one group: the metadata's own)
        slots, tables = md.plan.get("all_groups", (md.slot_mapping, md.block_tables))
        self.slot_mapping[:, :b].copy_(slots)
        self.block_tables[:, :b, :nb].copy_(tables)
        if bs > b:  # padding rows: write nothing, attend to one token of block 0
            self.slot_mapping[:, b:bs].fill_(-1)
            self.seq_lens[b:bs].fill_(1)
            self.block_tables[:, b:bs, 0].fill_(0)
        self.graphs[bs].replay()
        return self.outputs[bs][:b]
