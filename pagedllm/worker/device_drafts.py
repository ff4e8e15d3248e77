"""Drafts made on the device (speculative_config method "ngram_gpu"): each row's token history,
its newest drafts and what its last verification accepted, kept on the device so that one
step's samples become the next step's drafts without the host (async scheduling goes on while
speculating).

The path of a row's tokens, step S verifying k drafts at positions P..P+k:

- ``prepare`` (before S's forward pass): the drafts the lookup made after S - 1 go into the
  input ids at P+1..P+k; a snapshot of them is what S verifies (the lookup after S
  overwrites them).
- ``verify`` (after S's sampling): sample i predicts position P+i+1; ``a`` = the drafts equal
  to the samples before them (greedy: the argmax; random: an independent sample per position,
  which is rejection sampling for a one-token draft distribution); the bonus - sample ``a`` -
  is the next step's first input. The samples go into the history, the row's length becomes
  P+a+2, and the lookup (``spec_decode/ngram_gpu.py``) makes the drafts for S + 1.
- Under async scheduling S + 1 is planned before S's samples reach the host: the scheduler
  counts S's k drafts as accepted (``SchedulerOutput.spec_unverified``), and ``prepare`` of
  S + 1 takes the k - a rejected ones back off its positions, slots and lengths on the device
  (on a CPU, where the step is done when it returns, the runner corrects its host arrays
  instead).

On a GPU both are one Triton launch each (``ops/spec_drafts.py``); the PyTorch ops here are
the CPU's path and the kernels' reference.

Rows whose requests never draft still keep their history current (they may draft later).
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.spec_decode.ngram_gpu import ngram_propose_rows
from pagedllm.utils.pinned import PinnedRing


class DeviceDrafts:
    """Per-row device state of the n-gram lookup on the device (see the module docstring).

    ``hist``: [rows, max_model_len + k + 1] token ids (the last column takes writes past a
    row's end); ``lens``: [rows] tokens known per row; ``drafts`` / ``num_valid``: the newest
    lookup per row; ``accepted``: drafts accepted by the row's last verification.
    ``sched_appends`` (host): rows that have verified device drafts - from then on the
    scheduler, not the runner, puts the row's samples into its host token ids.
    """

    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        k: int,
        min_n: int,
        max_n: int,
        device: torch.device,
    ) -> None:
        self.k, self.min_n, self.max_n = k, min_n, max_n
        self.device = device
        self.width = max_model_len + k + 1
        self.dump = self.width - 1  # a column no position reaches: masked-out writes land here
        self.hist = torch.zeros(max_num_reqs, self.width, dtype=torch.int32, device=device)
        self.lens = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)
        self.drafts = torch.zeros(max_num_reqs, k, dtype=torch.int32, device=device)
        self.num_valid = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)
        self.accepted = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)
        self.sched_appends = np.zeros(max_num_reqs, dtype=bool)
        self._arange = torch.arange(k + 1, device=device)
        # the Triton kernels on a GPU (pagedllm/ops/spec_drafts.py); PyTorch ops on a CPU
        self.use_triton = device.type == "cuda"
        # a step's small index arrays reach the device through a ring of pinned buffers
        self._ring = PinnedRing(device, max(self.width, max_num_reqs * (3 * k + 5)) + 16)

    def ship(self, host: np.ndarray) -> torch.Tensor:
        """``host`` (a 1-D int array) as an int64 tensor on the device, copied without
        waiting for the device (``PinnedRing``)."""
        return self._ring.ship(host)

    def add_rows(self, rows: list[int], tokens: list[np.ndarray]) -> None:
        """(New or resumed) requests took ``rows``: their known tokens, no drafts; one copy
        for them all.

        Example: rows [4, 1] with 3 and 2 tokens -> one array of 5 tokens, lengths [3, 2];
        entry i goes to row [4, 4, 4, 1, 1][i] at column [0, 1, 2, 0, 1][i]."""
        lens = np.fromiter((t.shape[0] for t in tokens), dtype=np.int64, count=len(tokens))
        total = int(lens.sum())
        t = self.ship(np.concatenate([np.asarray(rows, dtype=np.int64), lens, *tokens]))
        num = len(rows)
        rows_t, lens_t, flat = t[:num], t[num : 2 * num], t[2 * num :]
        which = torch.repeat_interleave(
            torch.arange(num, device=self.device), lens_t, output_size=total
        )  # [total] the entry of each token
        starts = torch.cumsum(lens_t, 0) - lens_t
        cols = torch.arange(total, device=self.device) - starts[which]
        self.hist[rows_t[which], cols] = flat.to(self.hist.dtype)
        self.lens[rows_t] = lens_t
        self.num_valid[rows_t] = 0
        self.accepted[rows_t] = 0
        self.sched_appends[rows] = False

    def delta(self, rows: torch.Tensor, unverified: torch.Tensor) -> torch.Tensor:
        """[R] positions the host over-counts for each row of a step: the rejected drafts of
        its unresolved last step (``unverified``: [R] that step's drafts, 0 for a row whose
        last step is resolved). Example: 4 unverified, 1 accepted -> 3."""
        return torch.where(unverified > 0, unverified - self.accepted[rows], 0)

    def prepare(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        md: AttentionMetadata,
        n_sched: np.ndarray,
        rows: np.ndarray,
        unverified: np.ndarray,
        ks: np.ndarray,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Before a step's forward pass: correct the positions, lengths and slots of its rows
        whose last step is unresolved (``unverified`` [R]: that step's drafts, 0 otherwise; a
        row with some is a decode row) and write the drafts of the rows verifying ``ks`` [R]
        of them into ``input_ids`` after their first token. Returns what the step verifies:
        ``(drafts [R, k] int32, valid [R, k])`` (valid: a lookup's draft among the row's first
        ks). ``rows`` [R]: the InputBatch rows; ``n_sched`` [R]: tokens per row."""
        k = self.k
        assert not (unverified > 0).any() or n_sched[unverified > 0].max() <= k + 1
        meta = self.ship(np.concatenate([rows, unverified, ks]))
        slots, tables = md.plan.get("all_groups", (md.slot_mapping[None], md.block_tables[None]))
        if self.use_triton:
            from pagedllm.ops import spec_drafts

            return spec_drafts.prepare(
                input_ids, positions, md.seq_lens, md.query_start_loc, slots, tables, meta,
                self.accepted, self.drafts, self.num_valid, md.block_size,
            )  # fmt: skip
        num = len(rows)
        rows_t, unv_t, ks_t = meta[:num], meta[num : 2 * num], meta[2 * num :]
        if (unverified > 0).any():
            self._correct(positions, md, n_sched, self.delta(rows_t, unv_t), slots, tables)
        drafts = self.drafts[rows_t]  # [R, k] (a copy: the next lookup overwrites the rows)
        ar = self._arange[:k]
        used = ar[None, :] < ks_t[:, None]  # [R, k]
        valid = used & (ar[None, :] < self.num_valid[rows_t][:, None])
        # Example: k 4, rows with first tokens at [0, 5] and ks [2, 4] -> drafts at 1, 2 and
        # at 6..9
        first = torch.from_numpy(np.cumsum(n_sched) - n_sched).to(input_ids.device)
        dst = (first[:, None] + 1 + ar[None, :])[used]
        input_ids[dst] = drafts[used].to(input_ids.dtype)
        return drafts, valid

    def _correct(
        self,
        positions: torch.Tensor,
        md: AttentionMetadata,
        n_sched: np.ndarray,
        delta: torch.Tensor,
        slots: torch.Tensor,
        tables: torch.Tensor,
    ) -> None:
        """Take ``delta`` ([R] per request of the step) off its tokens' positions ([T], in
        place), its sequence lengths and its ``slots`` ([G, T], from ``tables`` [G, R, blocks]
        by position)."""
        total = int(n_sched.sum())
        req = torch.repeat_interleave(
            torch.arange(len(n_sched), device=self.device),
            torch.from_numpy(n_sched).to(self.device),
            output_size=total,
        )  # [T] the request of each token
        pos = positions[:total].to(torch.int64) - delta[req]  # [T]
        positions[:total] = pos.to(positions.dtype)
        md.seq_lens.sub_(delta.to(md.seq_lens.dtype))
        bs = md.block_size
        # Example: bs 16, table [7, 3], position 20 -> 3 * 16 + 4 = 52
        blocks = tables[:, req, pos // bs].to(torch.int64)  # [G, T]
        slots[:, :total] = (blocks * bs + pos % bs).to(slots.dtype)

    def verify(
        self,
        samples: torch.Tensor,
        rows: np.ndarray,
        first: np.ndarray,
        ks: np.ndarray,
        batch_idx: np.ndarray,
        seq_lens: torch.Tensor,
        used: torch.Tensor,
        valid: torch.Tensor,
        width: int,
        lookup: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """After a step's sampling: accept drafts, record the samples and look up the next
        drafts; returns [S] each sampling row's bonus token (its next input) and [S] the
        drafts its new lookup found (the scheduler plans that many next time: a row whose
        lookup finds nothing verifies no placeholders).

        ``samples``: [P] the step's samples; per sampling row: its InputBatch row ``rows``
        [S], its first sample ``first`` [S], its drafts ``ks`` [S] (0 without), its index in
        the step ``batch_idx`` [S]; ``seq_lens`` [R] the step's lengths (corrected: on the
        device); ``used`` / ``valid`` [R, k] what ``prepare`` returned. ``width``: a bound on
        every row's length after the step (the lookup reads that far). ``lookup`` False
        (speculation paused): the history only, no new drafts.

        Example: k 2, a row at P = 9 (length 12 = 9 + 1 + 2), drafts [5, 8], samples [5, 6,
        3] -> a = 1, the history gets 5 at 10 and 6 at 11 (3 at 12, past the new length 12),
        bonus 6."""
        samples = samples.to(torch.int64)
        meta = self.ship(np.concatenate([rows, first, ks, batch_idx]))
        width = min(width, self.width)
        num = len(rows)
        if self.use_triton:
            from pagedllm.ops import spec_drafts

            bonus = spec_drafts.verify(
                samples, meta, seq_lens, used, valid, self.hist, self.lens, self.accepted,
                self.drafts, self.num_valid, width, self.min_n, self.max_n, lookup,
            )  # fmt: skip
            return bonus, self.num_valid[meta[:num]]
        k = self.k
        rows_t, first_t, ks_t, bi = (meta[j * num : (j + 1) * num] for j in range(4))
        seq = seq_lens[bi].to(torch.int64)  # [S]
        cols = self._arange  # [k + 1]
        inb = cols[None, :] <= ks_t[:, None]  # [S, k + 1] the row's samples
        idx = torch.clamp(first_t[:, None] + cols[None, :], max=samples.shape[0] - 1)
        tok = samples[idx]  # [S, k + 1]
        eq = (tok[:, :k] == used[bi].to(tok.dtype)) & valid[bi].bool()  # [S, k]
        eq &= cols[None, :k] < ks_t[:, None]
        a = torch.cumprod(eq.to(torch.int64), dim=1).sum(dim=1)  # [S]
        bonus = tok.gather(1, a[:, None])[:, 0]  # [S]
        # sample j at position seq - ks + j (the row's first sample at seq - ks)
        pos = seq[:, None] - ks_t[:, None] + cols[None, :]  # [S, k + 1]
        pos = torch.where(inb, pos, self.dump)
        self.hist[rows_t[:, None].expand(-1, k + 1), pos] = tok.to(self.hist.dtype)
        self.lens[rows_t] = seq - ks_t + a + 1
        self.accepted[rows_t] = a
        if lookup:
            found, num_valid = ngram_propose_rows(
                self.hist[rows_t, :width], self.lens[rows_t], self.min_n, self.max_n, k
            )
            self.drafts[rows_t] = found
            self.num_valid[rows_t] = num_valid
        return bonus, self.num_valid[rows_t]
