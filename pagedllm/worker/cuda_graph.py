"""CUDA graphs for decode steps and for speculative-decoding steps.

One graph per (batch size, query length): batch sizes from a ladder (1, 2, 4, 8, 16, 24, 32,
... up to max_num_seqs); query length 1 for decode steps and, with speculative decoding,
k + 1 for the target's steps that verify k drafts per request (k + 2 for a draft model's
first pass after them: worker/drafter.py). All are captured largest first into one shared
memory pool.

A step of B requests whose rows each have at most q tokens (q = 1: a decode step; q = k + 1:
each request's newest token and its drafts, or fewer near ``max_tokens``) replays the graph of
the smallest captured size >= B with that q. The graph's buffers hold ``size * q`` token rows;
the step's T tokens fill the first T, padding tokens after them have slot -1 (their K/V are
never written) and belong to no request; padding requests have no query rows and a one-token
context, so they cost a little compute and touch nothing.

Example (q 5, size 4, a step of 3 requests with 5, 5 and 2 tokens): query_start_loc
[0, 5, 10, 12, 12] (the padding request is empty), tokens 12..19 are padding with slot -1;
the attention kernel's grid, sized from the captured shape, covers the tiles of every row.
"""

from __future__ import annotations

import logging

import torch

from pagedllm.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)

# Multi-token graphs are captured for batch sizes whose padded token count stays at most this
# (larger speculative steps run eagerly: at that size the launches are a small part of a step)
MAX_MULTI_TOKEN_ROWS = 2048


def capture_sizes(max_num_seqs: int) -> list[int]:
    """[1, 2, 4, 8, 16, 24, 32, 40, ...] up to max_num_seqs (capped at 512)."""
    top = min(max_num_seqs, 512)
    sizes = [s for s in (1, 2, 4, 8) if s <= top] + list(range(16, top + 1, 8))
    if top not in sizes:
        sizes.append(top)
    return sizes


class CUDAGraphRunner:
    """Captures ``model(input_ids, positions, metadata)`` for each (size, query length) and
    replays it (see the module docstring). ``query_lens``: the longest rows to capture (1,
    decode, is always among them)."""

    def __init__(
        self,
        model: torch.nn.Module,
        max_bs: int,
        max_blocks_per_req: int,
        block_size: int,
        max_model_len: int,
        device: torch.device,
        num_kv_groups: int = 1,
        query_lens: tuple[int, ...] = (1,),
    ) -> None:
        self.model = model
        self.sizes = capture_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.query_lens = tuple(sorted(set(query_lens) | {1}))
        # the sizes captured for each query length (multi-token ones: up to a token budget)
        self.sizes_for = {
            q: [s for s in self.sizes if q == 1 or s * q <= max(MAX_MULTI_TOKEN_ROWS, q)]
            for q in self.query_lens
        }
        n = max(s * q for q, sizes in self.sizes_for.items() for s in sizes)  # token rows
        r = self.max_bs  # request rows
        self.input_ids = torch.zeros(n, dtype=torch.int32, device=device)
        self.positions = torch.zeros(n, dtype=torch.int32, device=device)
        g = num_kv_groups  # slots and block tables per KV-cache group
        self.slot_mapping = torch.full((g, n), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(r, dtype=torch.int32, device=device)
        # decode graphs read the first size + 1 entries of arange; multi-token graphs their own
        self.query_start_loc = torch.arange(r + 1, dtype=torch.int32, device=device)
        self.multi_qsl = torch.zeros(r + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(g, r, max_blocks_per_req, dtype=torch.int32, device=device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.pool = None

    def _metadata(self, bs: int, q: int) -> AttentionMetadata:
        t = bs * q
        qsl = self.query_start_loc if q == 1 else self.multi_qsl
        md = AttentionMetadata(
            num_reqs=bs,
            num_actual_tokens=t,
            query_start_loc=qsl[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            slot_mapping=self.slot_mapping[0, :t],
            block_tables=self.block_tables[0, :bs],
            max_query_len=q,
            max_seq_len=self.max_model_len,  # graphs must cover any context length
            block_size=self.block_size,
        )
        if self.slot_mapping.shape[0] > 1:
            md.set_groups(self.slot_mapping[:, :t], self.block_tables[:, :bs])
        return md

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every (size, query length), the most token rows first, sharing one pool."""
        keys = [(bs, q) for q, sizes in self.sizes_for.items() for bs in sizes]
        for bs, q in sorted(keys, key=lambda k: (-k[0] * k[1], k[1])):
            if q > 1:  # q rows per request: [0, q, 2q, ...], each its own whole context
                self.multi_qsl[: bs + 1].copy_(self.query_start_loc[: bs + 1] * q)
                self.seq_lens[:bs].fill_(q)  # (a replay copies the step's lengths in)
            md = self._metadata(bs, q)
            t = bs * q
            args = (self.input_ids[:t], self.positions[:t], md)
            self.model(*args)  # warm up (Triton autotuning, lazy init) outside the graph
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                out = self.model(*args)
            if self.pool is None:
                self.pool = g.pool()
            self.graphs[bs, q] = g
            self.outputs[bs, q] = out
        torch.cuda.synchronize()
        done = [
            f"{len(s)} sizes up to {s[-1]} for {q}-token rows" for q, s in self.sizes_for.items()
        ]
        logger.info("captured CUDA graphs: %s", ", ".join(done))

    def _pick(self, num_reqs: int, max_query_len: int) -> tuple[int, int] | None:
        """The (size, query length) of the graph for a batch, or None (run it eagerly)."""
        if not self.graphs:
            return None
        for q in self.query_lens:
            if q >= max_query_len:
                sizes = self.sizes_for[q]
                if num_reqs <= sizes[-1]:
                    return next(s for s in sizes if s >= num_reqs), q
                return None
        return None

    def can_run(self, num_reqs: int, max_query_len: int = 1) -> bool:
        """Whether a batch of this many requests with rows of at most ``max_query_len`` tokens
        has a captured graph."""
        return self._pick(num_reqs, max_query_len) is not None

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        """Replay for a batch of ``md.num_reqs`` requests with rows of at most
        ``md.max_query_len`` tokens; returns [num_tokens, hidden]."""
        b, t = md.num_reqs, md.num_actual_tokens
        picked = self._pick(b, md.max_query_len)
        assert picked is not None, "no graph for this batch (check can_run first)"
        bs, q = picked
        padded = bs * q
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        self.seq_lens[:b].copy_(md.seq_lens)
        nb = md.block_tables.shape[1]
        # [G, t] slots and [G, b, nb] tables (one group: the metadata's own)
        slots, tables = md.plan.get("all_groups", (md.slot_mapping, md.block_tables))
        self.slot_mapping[:, :t].copy_(slots)
        self.block_tables[:, :b, :nb].copy_(tables)
        if q > 1:
            self.multi_qsl[: b + 1].copy_(md.query_start_loc)
            if bs > b:  # padding requests: no rows (every later entry is t)
                self.multi_qsl[b + 1 : bs + 1].fill_(t)
        if padded > t:  # padding tokens: write nothing
            self.slot_mapping[:, t:padded].fill_(-1)
        if bs > b:  # padding requests attend to one token of block 0
            self.seq_lens[b:bs].fill_(1)
            self.block_tables[:, b:bs, 0].fill_(0)
        self.graphs[bs, q].replay()
        return self.outputs[bs, q][:t]
