"""Drafts made on the device (speculative_config method "ngram_gpu"): each row's token history,
its newest drafts and what its last verification accepted, kept on the device so that one
step's samples become the next step's drafts without the host (async scheduling goes on while
speculating).

The path of a row's tokens, step S verifying k drafts at positions P..P+k:

- ``draft_inputs`` (prepare of S): the drafts the lookup made after S - 1 go into the input
  ids at P+1..P+k; a snapshot of them is what S verifies (the lookup after S overwrites them).
- ``verify`` (after S's sampling): sample i predicts position P+i+1; ``a`` = the drafts equal
  to the samples before them (greedy: the argmax; random: an independent sample per position,
  which is rejection sampling for a one-token draft distribution); the bonus - sample ``a`` -
  is the next step's first input. The samples go into the history, the row's length becomes
  P+a+2, and the lookup (``spec_decode/ngram_gpu.py``) makes the drafts for S + 1.
- Under async scheduling S + 1 is planned before S's samples reach the host: the scheduler
  counts S's k drafts as accepted (``SchedulerOutput.spec_unverified``), and ``correct`` takes
  the k - a rejected ones back off S + 1's positions, slots and lengths on the device (on a CPU,
  where the step is done when it returns, the runner corrects its host arrays instead).

Rows whose requests never draft still keep their history current (they may draft later).
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.spec_decode.ngram_gpu import ngram_propose_rows


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
        # Host-to-device copies of a step's small index arrays go through pinned buffers: a
        # copy from pageable memory waits for the work queued before it - under async
        # scheduling, the last step - and the steps would run one at a time. A ring of them,
        # each reused after the copy out of it has completed (long done by then).
        self._pinned: list[torch.Tensor] = []
        self._copied: list[torch.cuda.Event | None] = []
        self._turn = 0
        if device.type == "cuda":
            cap = max(self.width, max_num_reqs * (3 * k + 5)) + 16
            self._pinned = [torch.empty(cap, dtype=torch.int64, pin_memory=True) for _ in range(16)]
            self._copied = [None] * len(self._pinned)

    def ship(self, host: np.ndarray) -> torch.Tensor:
        """``host`` (a 1-D int array) as an int64 tensor on the device, copied without
        waiting for the device (through a pinned buffer on a GPU; the array itself on a
        CPU)."""
        if not self._pinned:
            return torch.from_numpy(np.ascontiguousarray(host, dtype=np.int64))
        turn = self._turn
        self._turn = (turn + 1) % len(self._pinned)
        if self._copied[turn] is not None:
            self._copied[turn].synchronize()
        n = int(host.shape[0])
        if n > self._pinned[turn].shape[0]:  # (new prompts longer than the buffer: rare)
            self._pinned[turn] = torch.empty(2 * n, dtype=torch.int64, pin_memory=True)
        buf = self._pinned[turn]
        buf.numpy()[:n] = host
        out = buf[:n].to(self.device, non_blocking=True)
        event = self._copied[turn] = torch.cuda.Event()
        event.record()
        return out

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

    def correct(
        self,
        positions: torch.Tensor,
        md: AttentionMetadata,
        n_sched: np.ndarray,
        delta: torch.Tensor,
    ) -> None:
        """Take ``delta`` ([num_reqs] per request of the step) off its tokens' positions
        ([num_tokens], in place), its sequence lengths and its slots (every KV-cache group's,
        from the tables by position) on the device: no host sync."""
        total = int(n_sched.sum())
        counts = self.ship(n_sched)
        req = torch.repeat_interleave(
            torch.arange(len(n_sched), device=self.device), counts, output_size=total
        )  # [num_tokens] the request of each token
        pos = positions[:total].to(torch.int64) - delta[req]  # [num_tokens]
        positions[:total] = pos.to(positions.dtype)
        md.seq_lens.sub_(delta.to(md.seq_lens.dtype))
        slots, tables = md.plan.get("all_groups", (md.slot_mapping[None], md.block_tables[None]))
        bs = md.block_size
        # Example: bs 16, table [7, 3], position 20 -> 3 * 16 + 4 = 52
        blocks = tables[:, req, pos // bs].to(torch.int64)  # [G, num_tokens]
        slots[:, :total] = (blocks * bs + pos % bs).to(slots.dtype)

    def draft_inputs(
        self, input_ids: torch.Tensor, rows: np.ndarray, first: np.ndarray, ks: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the drafts of ``rows`` ([D] rows verifying ``ks`` [D] drafts; the row's first
        token at flat index ``first`` [D]) into ``input_ids`` after their first token; returns
        the snapshot verified: ``(drafts [D, k], valid [D, k])`` (valid: the lookup's drafts
        among the first ks).

        Example: k 4, rows [3, 5] with first tokens at [0, 5] and ks [2, 4] -> row 3's drafts 0
        and 1 at 1 and 2, row 5's drafts 0..3 at 6..9."""
        k = self.k
        num = int(ks.sum())
        starts = np.repeat(np.cumsum(ks) - ks, ks)
        cols = np.arange(num) - starts  # [num] the draft of each entry within its row
        dst = np.repeat(first + 1, ks) + cols
        t = self.ship(np.concatenate([rows, ks, np.repeat(rows, ks), cols, dst]))
        d = len(rows)
        rows_t, ks_t = t[:d], t[d : 2 * d]
        rep_rows, rep_cols, dst_t = t[2 * d : 2 * d + num], t[2 * d + num : -num], t[-num:]
        input_ids[dst_t] = self.drafts[rep_rows, rep_cols].to(input_ids.dtype)
        drafts = self.drafts[rows_t]  # [D, k] (a copy: the next lookup overwrites the rows)
        ar = self._arange[:k]
        valid = (ar[None, :] < ks_t[:, None]) & (ar[None, :] < self.num_valid[rows_t][:, None])
        return drafts, valid

    def verify(
        self,
        samples: torch.Tensor,
        rows: torch.Tensor,
        first: torch.Tensor,
        ks: torch.Tensor,
        seq_lens: torch.Tensor,
        drafts: torch.Tensor | None,
        valid: torch.Tensor | None,
        draft_idx: torch.Tensor | None,
        width: int,
        lookup: bool = True,
    ) -> torch.Tensor:
        """Accept drafts, record the samples and look up the next drafts; returns [S] each
        sampling row's bonus token (its next input).

        ``samples``: [P] the step's samples; per sampling row (``rows`` [S]): its first sample
        ``first`` [S], its drafts ``ks`` [S] (0 without), its length after the step
        ``seq_lens`` [S] (corrected: on the device); ``drafts`` / ``valid`` [D, k] what the rows
        at ``draft_idx`` [D] (indices into the S rows) verified (None: no row had drafts).
        ``width``: a bound on every row's length after the step (the lookup reads that far).
        ``lookup`` False (speculation paused): the history only, no new drafts.

        Example: k 2, a row at P = 9 (seq_len 12 = 9 + 1 + 2), drafts [5, 8], samples [5, 6,
        3] -> a = 1, the history gets 5 at 10 and 6 at 11 (3 at 12, past the new length 12),
        bonus 6."""
        k = self.k
        num = rows.shape[0]
        cols = self._arange  # [k + 1]
        inb = cols[None, :] <= ks[:, None]  # [S, k + 1] the row's samples
        idx = torch.clamp(first[:, None] + cols[None, :], max=samples.shape[0] - 1)
        tok = samples[idx]  # [S, k + 1]
        a = torch.zeros(num, dtype=torch.int64, device=self.device)
        if drafts is not None and drafts.shape[0] > 0:
            assert valid is not None and draft_idx is not None
            eq = (tok[draft_idx, :k] == drafts.to(tok.dtype)) & valid  # [D, k]
            a[draft_idx] = torch.cumprod(eq.to(torch.int64), dim=1).sum(dim=1)
        bonus = tok.gather(1, a[:, None])[:, 0]  # [S]
        # sample i at position seq_len - ks + i (the row's first sample at seq_len - ks)
        pos = seq_lens.to(torch.int64)[:, None] - ks[:, None] + cols[None, :]  # [S, k + 1]
        pos = torch.where(inb, pos, self.dump)
        self.hist[rows[:, None].expand(-1, k + 1), pos] = tok.to(self.hist.dtype)
        self.lens[rows] = seq_lens.to(torch.int64) - ks + a + 1
        self.accepted[rows] = a
        if not lookup:
            return bonus
        w = min(width, self.width)
        found, num_valid = ngram_propose_rows(
            self.hist[rows, :w], self.lens[rows], self.min_n, self.max_n, k
        )
        self.drafts[rows] = found
        self.num_valid[rows] = num_valid
        return bonus
