"""Per-step SamplingMetadata from the InputBatch rows that sample."""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.sample.constraints import TokenConstraints, step_constraints
from pagedllm.sample.sampler import SamplingMetadata
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.input_batch import InputBatch


def build_sampling_metadata(
    ib: InputBatch,
    rows: np.ndarray,
    device: torch.device,
    generator: torch.Generator,
    eos_token_ids: set[int],
    drafts: list[list[int]] | None = None,
) -> SamplingMetadata:
    """Sampling metadata of the InputBatch ``rows`` ([S]) that sample this step.

    Entries, in order: the P sampling positions, then the F extra samples of parallel
    sampling. Without ``drafts`` each row samples once (P = S). With ``drafts`` (per row, the
    draft tokens it verifies) a row samples at 1 + k positions: its parameters repeat, its
    output position counts up and its output tokens (for penalties) grow by the drafts, as if
    the drafts were its tokens. A position at output 0 of a request with n > 1 sequences
    draws n - 1 extra samples from the same logits (``SamplingMetadata.fork_counts``), extra
    sample i with seed s + i, as core/sched/groups.py's seeding rule says.
    """
    out_pos = ib.num_tokens[rows] - ib.num_prompt_tokens[rows]  # [S]
    draft_prefix: list[list[int]] | None = None
    if drafts is not None:
        counts = np.fromiter((len(d) + 1 for d in drafts), dtype=np.int64, count=len(drafts))
        # Example: counts [1, 3] -> owner [0, 1, 1, 1], step [0, 0, 1, 2]
        owner = np.repeat(np.arange(len(rows)), counts)
        step = np.arange(len(owner)) - np.repeat(np.cumsum(counts) - counts, counts)
        rows, out_pos = rows[owner], out_pos[owner] + step
        draft_prefix = [drafts[o][:j] for o, j in zip(owner.tolist(), step.tolist())]
    num_pos = len(rows)
    seed_offset = None
    fork_counts = ib.columns.forks[rows]  # [P] n - 1 per position (a copy)
    if fork_counts.any():  # some row of a request with n > 1: fork at its output 0 only
        fork_counts[out_pos != 0] = 0
    if fork_counts.any():
        # Example: fork_counts [0, 2, 0, 1] -> src [1, 1, 3], seed offsets [1, 2, 1]
        src = np.repeat(np.arange(num_pos), fork_counts)
        first = np.repeat(np.cumsum(fork_counts) - fork_counts, fork_counts)
        seed_offset = np.concatenate([np.zeros(num_pos, np.int64), np.arange(len(src)) - first + 1])
        rows = np.concatenate([rows, rows[src]])
        out_pos = np.concatenate([out_pos, np.zeros(len(src), dtype=np.int64)])
        if draft_prefix is not None:
            draft_prefix += [[] for _ in range(len(src))]  # output 0: no draft before
    md = _build(ib, rows, out_pos, seed_offset, draft_prefix, device, generator, eos_token_ids)
    if seed_offset is not None:
        md.fork_counts = fork_counts
        md.fork_src = torch.from_numpy(src).to(device, non_blocking=True)
    return md


def _build(
    ib: InputBatch,
    rows: np.ndarray,  # [B] the InputBatch row of each entry
    out_pos: np.ndarray,  # [B] index of the token each entry samples in its row's output
    seed_offset: np.ndarray | None,  # [B] added to a seeded entry's seed (forks)
    draft_prefix: list[list[int]] | None,  # [B] drafts before each entry's position
    device: torch.device,
    generator: torch.Generator,
    eos_token_ids: set[int],
) -> SamplingMetadata:
    """Parameter columns are built only when some entry needs them: an all-greedy batch makes
    no tensors at all (no host-to-device copies). Token lists for penalties are fetched only
    when some entry uses penalties; the SamplingParams themselves only for the entries with a
    seed, a penalty or an active min_tokens."""
    columns = ib.columns
    values = columns.values[rows]  # [B, 4]
    all_greedy = bool(columns.greedy[rows].all())
    seeds: list[int | None] = [None] * len(rows)
    for i in np.flatnonzero(columns.seeded[rows]).tolist():
        seed = _params(ib, rows, i).seed
        assert seed is not None
        seeds[i] = seed if seed_offset is None else seed + int(seed_offset[i])
    md = SamplingMetadata(
        temperature=torch.zeros(0),
        top_p=torch.zeros(0),
        top_k=torch.zeros(0, dtype=torch.int64),
        min_p=torch.zeros(0),
        seeds=seeds,
        output_positions=out_pos.tolist(),
        all_greedy=all_greedy,
        any_top_p=bool((values[:, 1] < 1.0).any()),
        any_top_k=bool((values[:, 2] > 0).any()),
        any_min_p=bool((values[:, 3] > 0.0).any()),
        generator=generator,
    )
    if not all_greedy:
        cols = torch.from_numpy(values).to(device, non_blocking=True)
        md.temperature, md.top_p, md.min_p = cols[:, 0], cols[:, 1], cols[:, 3]
        md.top_k = cols[:, 2].long()
    if columns.penalized[rows].any():
        params = [_params(ib, rows, i) for i in range(len(rows))]
        pen = torch.tensor(
            [[p.presence_penalty, p.frequency_penalty, p.repetition_penalty] for p in params],
            dtype=torch.float32,
        ).to(device, non_blocking=True)
        md.presence, md.frequency, md.repetition = pen[:, 0], pen[:, 1], pen[:, 2]
        md.prompt_ids = [ib.prompt_ids(int(r)) for r in rows]
        md.output_ids = [ib.output_ids(int(r)) for r in rows]
        if draft_prefix is not None:
            md.output_ids = [o + d for o, d in zip(md.output_ids, draft_prefix)]
    masks = []
    for i in np.flatnonzero(out_pos < columns.min_tokens[rows]).tolist():
        p = _params(ib, rows, i)
        stop_ids = set(p.all_stop_token_ids)
        if not p.ignore_eos:
            stop_ids |= eos_token_ids
        if stop_ids:
            masks.append((i, sorted(stop_ids)))
    md.min_tokens_masks = masks or None
    if columns.constrained[rows].any():
        md.constraints = _constraints(ib, rows, draft_prefix, device)
    md.max_num_logprobs = int(columns.logprobs[rows].max(initial=-1))
    return md


def _constraints(
    ib: InputBatch,
    rows: np.ndarray,  # [B] the InputBatch row of each entry
    draft_prefix: list[list[int]] | None,  # [B] drafts before each entry's position
    device: torch.device,
) -> TokenConstraints | None:
    """The step's logit_bias / allowed_token_ids / bad_words over the entries whose rows have
    any; the last output tokens (with drafts) only of entries with multi-token bad words."""
    entries = np.flatnonzero(ib.columns.constrained[rows]).tolist()
    cons, tails = [], []
    for i in entries:
        row = int(rows[i])
        c = ib.columns.constraints[row]
        assert c is not None
        tail: list[int] = []
        if c.history:
            start = max(int(ib.num_prompt_tokens[row]), int(ib.num_tokens[row]) - c.history)
            tail = ib.token_ids[row, start : ib.num_tokens[row]].tolist()
            if draft_prefix is not None and draft_prefix[i]:
                tail = (tail + draft_prefix[i])[-c.history :]
        cons.append(c)
        tails.append(tail)
    return step_constraints(entries, cons, tails, device)


def _params(ib: InputBatch, rows: np.ndarray, i: int) -> SamplingParams:
    p = ib.sampling_params[int(rows[i])]
    assert p is not None
    return p
