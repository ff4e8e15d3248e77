"""The sampler: one documented pipeline from logits to token ids (float32 logits; a step whose
rows are all plain argmax (``SamplingMetadata.argmax_only``) may pass them in the model dtype).

    raw logits ──► logprobs for the client (raw model distribution, as vLLM reports them)
        │
        ├─► allowed_token_ids (every other token -inf)
        ├─► bad_words (a word's last token -inf after its other tokens)
        ├─► min_tokens mask (EOS and stop tokens forbidden until min_tokens)
        ├─► logit_bias (added to the logits)
        ├─► penalties (repetition, frequency, presence)
        ├─► greedy rows: argmax
        └─► temperature ─► top-k ─► top-p ─► min-p ─► softmax ─► exponential race

Parallel sampling (n > 1): a row may draw extra samples from its own logits
(``SamplingMetadata.fork_counts``); they are rows appended to the batch - the same pipeline,
one pass - and come back apart, in ``SamplerOutput.forks``.

The order of the masks and the bias is vLLM V1's: the whitelist and bad words first, then its
non-argmax-invariant logits processors (min_tokens, then logit_bias), then penalties. A
token masked to -inf stays there whatever its bias. The constraints are flat index tensors
over all rows (forks included), one indexed write per kind a step (``sample/constraints.py``).
min_tokens never leaves a row without a token: where its mask would (a grammar that accepts
only EOS now, allowed_token_ids of stop tokens only), the row samples as if min_tokens were
met (vLLM samples token 0 there, which a grammar then rejects). A row whose every token is
masked otherwise (allowed_token_ids all banned as bad words) samples token 0, as in vLLM.

The exponential race picks argmax(p / q) with q ~ Exp(1), which samples from p without a
device sync (no multinomial). A request with a ``seed`` draws its q from a generator seeded by
(seed, output position), so its tokens depend on nothing else in the batch, nor on preemption.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.ops.cpu import argmax
from pagedllm.sample.constraints import TokenConstraints
from pagedllm.sample.penalties import apply_penalties

_EPS = 1e-5


@dataclass
class SamplingMetadata:
    """Per-row sampling parameters of the rows that sample this step.

    With parallel sampling the per-row fields cover the logits' B rows and then the F extra
    samples (``fork_src``): B + F entries."""

    temperature: torch.Tensor  # [B] float32
    top_p: torch.Tensor  # [B]
    top_k: torch.Tensor  # [B] int64, 0 = off
    min_p: torch.Tensor  # [B]
    seeds: list[int | None]
    output_positions: list[int]  # index of the token being sampled in each row's output
    all_greedy: bool
    any_top_p: bool
    any_top_k: bool
    any_min_p: bool
    # Penalties (None when no row uses them)
    presence: torch.Tensor | None = None
    frequency: torch.Tensor | None = None
    repetition: torch.Tensor | None = None
    prompt_ids: list[list[int]] | None = None
    output_ids: list[list[int]] | None = None
    # min_tokens: rows and the token ids they may not sample yet
    min_tokens_masks: list[tuple[int, list[int]]] | None = None
    # logit_bias, allowed_token_ids, bad_words (None when no row uses them this step)
    constraints: TokenConstraints | None = None
    max_num_logprobs: int = -1  # -1: no row wants logprobs
    generator: torch.Generator | None = None
    # Parallel sampling: [B] extra samples each row draws from its logits (None: none), and
    # [F] the logits row of each extra sample, in order (e.g. counts [0, 2, 1] -> [1, 1, 2]).
    fork_counts: np.ndarray | None = None
    fork_src: torch.Tensor | None = None

    @property
    def argmax_only(self) -> bool:
        """Every row is a plain argmax of the raw logits (greedy, no penalties, no min_tokens
        mask, no token constraints, no logprobs): the logits may stay in the model dtype (its
        argmax is the float32 one, ties included, as the upcast is exact)."""
        return (
            self.all_greedy
            and self.max_num_logprobs < 0
            and self.presence is None
            and not self.min_tokens_masks
            and self.constraints is None
        )


@dataclass
class SamplerOutput:
    sampled: torch.Tensor  # [B] int64
    # top-N logprobs: ids [B, N+1], logprobs [B, N+1], ranks [B, N+1]; column 0 is the sampled
    logprob_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    ranks: torch.Tensor | None = None
    forks: SamplerOutput | None = None  # the F extra samples (``SamplingMetadata.fork_src``)

    def logprob_tensors(self) -> list[torch.Tensor]:
        """[ids, logprobs, ranks], [rows, N + 1] each (the step asked for logprobs)."""
        assert self.logprob_ids is not None and self.logprobs is not None
        assert self.ranks is not None
        return [self.logprob_ids, self.logprobs, self.ranks]

    def split(self, num_rows: int) -> SamplerOutput:
        """The first ``num_rows`` rows, with the rest as ``forks`` (views, no copies)."""
        lp = (self.logprob_ids, self.logprobs, self.ranks)
        head = [t[:num_rows] if t is not None else None for t in lp]
        tail = [t[num_rows:] if t is not None else None for t in lp]
        rest = SamplerOutput(self.sampled[num_rows:], *tail)
        return SamplerOutput(self.sampled[:num_rows], *head, forks=rest)


class Sampler:
    """Samples one token per row, and the extra samples of rows that fork (see module
    docstring)."""

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        """Sample ``logits`` ([B, vocab]) under ``md``; ``forks`` holds the extra samples."""
        num_rows = logits.shape[0]
        if md.fork_src is not None:
            # each extra sample is one more row of its row's logits: [B + F, vocab]
            logits = torch.cat([logits, logits.index_select(0, md.fork_src)])
        raw = logits
        cons = md.constraints
        if md.min_tokens_masks or md.presence is not None or cons is not None:
            logits = logits.clone()  # raw stays for the logprobs
        if cons is not None:
            cons.mask(logits)  # allowed_token_ids, bad_words
        if md.min_tokens_masks:
            self._min_tokens(logits, md.min_tokens_masks)
        if cons is not None:
            cons.add_bias(logits)
        if md.presence is not None:
            assert md.frequency is not None and md.repetition is not None
            assert md.prompt_ids is not None and md.output_ids is not None
            logits = apply_penalties(
                logits, md.prompt_ids, md.output_ids, md.presence, md.frequency, md.repetition
            )
        greedy = argmax(logits)  # [B]
        if md.all_greedy:
            sampled = greedy
        else:
            sampled = self._random(logits, md)
            sampled = torch.where(md.temperature < _EPS, greedy, sampled)
        out = SamplerOutput(sampled=sampled)
        if md.max_num_logprobs >= 0:
            self._logprobs(raw, sampled, md.max_num_logprobs, out)
        return out.split(num_rows) if md.fork_src is not None else out

    @staticmethod
    def _min_tokens(logits: torch.Tensor, masks: list[tuple[int, list[int]]]) -> None:
        """Forbid each row's stop tokens, except in a row the mask would leave with no token
        at all (a grammar that only accepts EOS now, allowed_token_ids of stop tokens only):
        that row samples as if min_tokens were met (no device sync: one where over the rows)."""
        rows = torch.tensor([r for r, _ in masks], device=logits.device)
        before = logits.index_select(0, rows)  # [M, vocab]
        for row, ids in masks:
            logits[row, ids] = -float("inf")
        after = logits.index_select(0, rows)
        dead = (after == -float("inf")).all(dim=-1, keepdim=True)  # [M, 1]
        logits.index_copy_(0, rows, torch.where(dead, before, after))

    def _random(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        temp = torch.where(md.temperature < _EPS, torch.ones_like(md.temperature), md.temperature)
        logits = logits / temp[:, None]
        if md.any_top_k or md.any_top_p:
            logits = apply_top_k_top_p(
                logits, md.top_k if md.any_top_k else None, md.top_p if md.any_top_p else None
            )
        probs = logits.softmax(dim=-1)
        if md.any_min_p:
            top = probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < md.min_p[:, None] * top, 0.0)
        q = torch.empty_like(probs)
        q.exponential_(generator=md.generator)
        for i, seed in enumerate(md.seeds):
            if seed is not None:
                g = torch.Generator(device=probs.device)
                g.manual_seed(_mix(seed, md.output_positions[i]))
                q[i].exponential_(generator=g)
        return argmax(probs.div(q))

    @staticmethod
    def _logprobs(raw: torch.Tensor, sampled: torch.Tensor, n: int, out: SamplerOutput) -> None:
        lp = raw.log_softmax(dim=-1)
        sampled_lp = lp.gather(1, sampled[:, None])  # [B, 1]
        sampled_rank = (lp > sampled_lp).sum(dim=-1, keepdim=True) + 1
        if n > 0:
            top_lp, top_ids = lp.topk(n, dim=-1)
            ranks = torch.arange(1, n + 1, device=lp.device).expand(lp.shape[0], n)
            out.logprob_ids = torch.cat([sampled[:, None], top_ids], dim=1)
            out.logprobs = torch.cat([sampled_lp, top_lp], dim=1)
            out.ranks = torch.cat([sampled_rank, ranks], dim=1)
        else:
            out.logprob_ids, out.logprobs, out.ranks = sampled[:, None], sampled_lp, sampled_rank


def _mix(seed: int, position: int) -> int:
    # splitmix64-style mix of (seed, position) into a 63-bit generator seed
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 1) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 31
    x = (x * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 29)) & 0x7FFFFFFFFFFFFFFF


def apply_top_k_top_p(
    logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None
) -> torch.Tensor:
    """Mask logits outside each row's top-k and top-p nucleus to -inf (k 0 = off).
    The most likely token always survives."""
    sorted_logits, idx = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    if k is not None:
        kk = torch.where(k <= 0, torch.full_like(k, vocab), k.clamp(max=vocab))
        # ascending sort: the k-th largest sits at index vocab - k
        thresh = sorted_logits.gather(1, (vocab - kk)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < thresh, -float("inf"))
    if p is not None:
        probs = sorted_logits.softmax(dim=-1)
        cum = probs.cumsum(dim=-1)
        drop = cum <= (1.0 - p[:, None])
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, -float("inf"))
    return torch.empty_like(logits).scatter_(1, idx, sorted_logits)
