"""Where a step samples: which rows, at which token positions, and how the samples come back.

Without draft tokens (the common path) each row that reaches the end of its known tokens
samples once, from the logits of its last token. A row verifying k draft tokens (speculative
decoding: ``SchedulerOutput.scheduled_spec_tokens``) is scheduled 1 + k tokens - its last
known token and the k drafts, written after its known tokens as inputs only - and samples at
each of those k + 1 positions: sample j predicts the token after draft j - 1 (sample 0: the
token after the known ones, the one a plain decode would sample). The runner commits sample 0
alone to the row (``InputBatch.num_tokens`` counts it, as for a plain decode); the drafts are
never committed here (see ``SchedulerOutput.scheduled_spec_tokens`` for the scheduler's part).

The sampler sees P sampling positions (P = S, the sampling rows, without drafts), the rows'
parameters repeated for their positions; ``SamplePlan`` maps positions back to requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.worker.input_batch import InputBatch


@dataclass
class SamplePlan:
    """The sampling rows of one step and the flat token index of each sample's logits."""

    sample_idx: np.ndarray  # [S] batch indices of the rows that sample, ascending
    logits_idx: np.ndarray  # [P] flat token index whose logits each sample reads
    # [S] samples per sampling row (1 + its drafts); None when no row has drafts (1 each)
    num_samples: np.ndarray | None = None
    drafts: list[list[int]] | None = None  # [S] each sampling row's draft tokens, or None

    @property
    def first(self) -> np.ndarray | None:
        """[S] the position of each sampling row's first sample (None: no drafts, the identity).
        Example: num_samples [3, 1, 2] -> [0, 3, 4]."""
        if self.num_samples is None:
            return None
        return np.cumsum(self.num_samples) - self.num_samples

    def position_owner(self) -> np.ndarray:
        """[P] the batch index of each sampling position's request."""
        if self.num_samples is None:
            return self.sample_idx
        return np.repeat(self.sample_idx, self.num_samples)

    def token_lists(self, tokens: np.ndarray, num_reqs: int) -> list[list[int]]:
        """Per batch row, its samples (``tokens``: [P]) in position order; [] for a row that
        did not sample."""
        out: list[list[int]] = [[] for _ in range(num_reqs)]
        if self.num_samples is None:
            for i, tok in zip(self.sample_idx.tolist(), tokens.tolist()):
                out[i] = [tok]
            return out
        ends = np.cumsum(self.num_samples).tolist()
        flat = tokens.tolist()
        for i, s, e in zip(self.sample_idx.tolist(), [0] + ends[:-1], ends):
            out[i] = flat[s:e]
        return out

    def logprob_lists(self, host: list[torch.Tensor], num_reqs: int) -> list:
        """Per batch row: [(top ids, logprobs, ranks)] of each of its samples, or None.
        ``host``: the sampler's [P, N + 1] logprob ids, logprobs and ranks."""
        ids, lps, ranks = (t.tolist() for t in host)
        result: list = [None] * num_reqs
        if self.num_samples is None:
            for j, i in enumerate(self.sample_idx.tolist()):
                result[i] = [(ids[j], lps[j], ranks[j])]
            return result
        j = 0
        for i, n in zip(self.sample_idx.tolist(), self.num_samples.tolist()):
            result[i] = [(ids[p], lps[p], ranks[p]) for p in range(j, j + n)]
            j += n
        return result

    def fork_lists(
        self,
        req_ids: list[str],
        fork_counts: np.ndarray,
        tokens: np.ndarray,
        logprobs: list[torch.Tensor] | None,
    ) -> tuple[dict[str, list[int]], dict[str, list]]:
        """Parallel sampling: per request that forks, the first tokens of its sequences
        1..n-1 (``tokens``: [F] the sampler's extra samples, in position order; ``fork_counts``:
        [P] extra samples per position) and, when asked, their logprob triples."""
        owner = self.position_owner()
        flat = tokens.tolist()
        lp = [t.tolist() for t in logprobs] if logprobs is not None else None
        out_tokens: dict[str, list[int]] = {}
        out_lps: dict[str, list] = {}
        j = 0
        for p in np.flatnonzero(fork_counts).tolist():
            k = int(fork_counts[p])
            rid = req_ids[int(owner[p])]
            out_tokens[rid] = flat[j : j + k]
            if lp is not None:
                out_lps[rid] = [(lp[0][q], lp[1][q], lp[2][q]) for q in range(j, j + k)]
            j += k
        return out_tokens, out_lps


def plan_samples(
    ib: InputBatch,
    spec_tokens: dict[str, list[int]],
    req_ids: list[str],
    rows: np.ndarray,
    seq_lens: np.ndarray,
    cu: np.ndarray,
    always: np.ndarray | None = None,
) -> SamplePlan:
    """The step's sampling rows and logits positions (``rows``, ``seq_lens``: [num_reqs]
    InputBatch rows and lengths after the step; ``cu``: cumulative scheduled tokens).

    Rows that reach the end of their known tokens (and drafts) sample; a prefill chunk that
    stops short of the prompt's end samples nothing. Writes each row's drafts into its token
    ids after the known tokens (inputs only: ``num_tokens`` does not count them). ``always``
    ([num_reqs] or None): rows that sample whatever their host counts say (drafts made on the
    device: the scheduler appends their tokens, so the runner's counts lag behind)."""
    if not spec_tokens:
        # the logits come from each row's last token: e.g. n_sched [3, 1, 2], all sampling
        # -> cu [3, 4, 6] -> flat token indices [2, 3, 5]
        samples = seq_lens == ib.num_tokens[rows]
        if always is not None:
            samples |= always
        sample_idx = np.nonzero(samples)[0]
        return SamplePlan(sample_idx, cu[sample_idx] - 1)
    num_spec = np.zeros(len(rows), dtype=np.int64)  # [num_reqs] drafts per row
    batch_of_row = np.full(ib.max_num_reqs, -1, dtype=np.int64)
    batch_of_row[rows] = np.arange(len(rows))
    for rid, draft in spec_tokens.items():  # only the rows with drafts
        if not draft:
            continue
        row = ib.req_id_to_row[rid]
        i = int(batch_of_row[row])
        assert i >= 0, f"drafts for {rid!r}, which is not scheduled"
        n = int(ib.num_tokens[row])
        assert n + len(draft) <= ib.max_model_len, "drafts past max_model_len"
        ib.token_ids[row, n : n + len(draft)] = draft
        num_spec[i] = len(draft)
    samples = seq_lens == ib.num_tokens[rows] + num_spec
    if always is not None:
        samples |= always
    sample_idx = np.nonzero(samples)[0]
    counts = num_spec[sample_idx] + 1  # [S]
    # A row's samples read its last 1 + k tokens. Example: n_sched [4, 1, 3] (cu [4, 5, 8]),
    # all sampling, drafts [2, 0, 2] -> counts [3, 1, 3]; starts cu - counts = [1, 4, 5]
    # -> [1, 1, 1, 4, 5, 5, 5] + offsets [0, 1, 2, 0, 0, 1, 2] = [1, 2, 3, 4, 5, 6, 7]
    total = int(counts.sum())
    starts = np.repeat(cu[sample_idx] - counts, counts)
    offsets = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
    drafts = [list(spec_tokens.get(req_ids[i]) or ()) for i in sample_idx.tolist()]
    return SamplePlan(sample_idx, starts + offsets, counts, drafts)
