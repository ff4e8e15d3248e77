"""Token constraints of vLLM's SamplingParams: ``allowed_token_ids``, ``bad_words`` and
``logit_bias``, applied to a whole step's logits with one indexed write per kind.

Each request's constraints become numpy arrays once, when it gets its row
(``RowConstraints.of``). A step gathers the arrays of its entries that have any into flat
(entry, token id) index arrays on the host (``step_constraints``), copies them to the device
in one transfer per dtype, and the sampler writes them into the logits:

    allowed_token_ids   the entries' rows to -inf, then their allowed logits put back
    bad_words           -inf at (entry, banned id)
    logit_bias          += bias at (entry, id)  (after the min_tokens mask: see sampler.py)

Example: entries 0 and 2 have logit_bias {5: 1.0, 9: -2.0} and {7: 3.0} ->
rows [0, 0, 2], ids [5, 9, 7], values [1.0, -2.0, 3.0]: one ``index_put_``.

A bad word of k tokens [t1..tk] bans tk when the entry's last k - 1 output tokens (with the
drafts before its position, under speculative decoding) are t1..tk-1; one-token words are
always banned. Multi-token words read the output on the host each step, so such requests keep
the engine in synchronous steps (``Request.needs_host_tokens``).

Cost: host work and transfer proportional to the constrained entries' ids (an entry limited to
most of the vocabulary copies most of it each step); nothing for entries without constraints,
and no tensors at all in a step without any.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.sampling_params import SamplingParams


@dataclass(frozen=True)
class RowConstraints:
    """One request's constraints as arrays, built once when it gets an InputBatch row."""

    bias_ids: np.ndarray | None  # [nb] int64
    bias_values: np.ndarray | None  # [nb] float32
    allowed_ids: np.ndarray | None  # [na] int64, unique
    banned_ids: np.ndarray | None  # [ns] int64: the one-token bad words
    sequences: tuple[tuple[tuple[int, ...], int], ...]  # longer bad words: (t1..tk-1, tk)
    history: int  # output tokens a step looks back at (the longest t1..tk-1)

    @classmethod
    def of(cls, p: SamplingParams) -> RowConstraints | None:
        """The arrays of ``p`` (tokenized by the engine), or None when it has no constraint."""
        assert not p.bad_words or p.bad_words_token_ids is not None, (
            "bad_words not tokenized (InputProcessor.process calls update_from_tokenizer)"
        )
        if not p.uses_token_constraints:
            return None
        bias_ids = bias_values = allowed = banned = None
        if p.logit_bias:
            bias_ids = np.fromiter(p.logit_bias.keys(), dtype=np.int64, count=len(p.logit_bias))
            bias_values = np.fromiter(
                p.logit_bias.values(), dtype=np.float32, count=len(p.logit_bias)
            )
        if p.allowed_token_ids is not None:
            allowed = np.unique(np.asarray(p.allowed_token_ids, dtype=np.int64))
        seqs = p.bad_words_token_ids or []
        singles = [s[0] for s in seqs if len(s) == 1]
        if singles:
            banned = np.unique(np.asarray(singles, dtype=np.int64))
        longer = tuple((tuple(s[:-1]), s[-1]) for s in seqs if len(s) > 1)
        history = max((len(prefix) for prefix, _ in longer), default=0)
        return cls(bias_ids, bias_values, allowed, banned, longer, history)

    def banned_after(self, tail: list[int]) -> list[int]:
        """Last tokens of the longer bad words whose other tokens end ``tail`` (the entry's
        last output tokens, at least ``history`` of them when the output is that long)."""
        n = len(tail)
        return [
            last
            for prefix, last in self.sequences
            if len(prefix) <= n and tuple(tail[n - len(prefix) :]) == prefix
        ]


@dataclass
class TokenConstraints:
    """A step's constraints as flat index tensors over the sampler's entries (the logits'
    rows, forks included); a kind no entry uses is None."""

    allowed_rows: torch.Tensor | None = None  # [A] int64 entries limited to allowed ids
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None  # [N] entry, [N] token id
    banned: tuple[torch.Tensor, torch.Tensor] | None = None  # [M] entry, [M] token id
    bias: tuple[torch.Tensor, torch.Tensor] | None = None  # [K] entry, [K] token id
    bias_values: torch.Tensor | None = None  # [K] float32

    def mask(self, logits: torch.Tensor) -> None:
        """allowed_token_ids, then bad_words, in place on ``logits`` ([B, vocab] float32)."""
        if self.allowed is not None:
            assert self.allowed_rows is not None
            kept = logits[self.allowed]  # [N]
            logits.index_fill_(0, self.allowed_rows, -float("inf"))
            logits.index_put_(self.allowed, kept)
        if self.banned is not None:
            logits.index_put_(self.banned, logits.new_full((), -float("inf")))

    def add_bias(self, logits: torch.Tensor) -> None:
        """logit_bias, in place on ``logits`` ([B, vocab] float32)."""
        if self.bias is not None:
            assert self.bias_values is not None
            logits.index_put_(self.bias, self.bias_values, accumulate=True)


def step_constraints(
    entries: list[int],
    rows: list[RowConstraints],
    tails: list[list[int]],
    device: torch.device,
) -> TokenConstraints | None:
    """The flat index tensors of a step whose sampler ``entries`` ([C], ascending) have the
    constraints ``rows`` ([C]); ``tails`` ([C]) are their last output tokens (only read for
    entries with longer bad words). None when nothing applies this step (e.g. only longer bad
    words, none of whose prefixes ends the output)."""
    allowed_e, allowed_ids, banned_e, banned_ids, bias_e, bias_ids, bias_v = ([] for _ in range(7))
    for e, c, tail in zip(entries, rows, tails):
        if c.allowed_ids is not None:
            allowed_e.append(e)
            allowed_ids.append(c.allowed_ids)
        if c.banned_ids is not None:
            banned_e.append(e)
            banned_ids.append(c.banned_ids)
        if c.sequences and tail:
            hits = c.banned_after(tail)
            if hits:
                banned_e.append(e)
                banned_ids.append(np.asarray(hits, dtype=np.int64))
        if c.bias_ids is not None:
            bias_e.append(e)
            bias_ids.append(c.bias_ids)
            bias_v.append(c.bias_values)
    # one int64 host array -> one copy, then views:
    # [allowed rows | allowed entry, id | banned entry, id | bias entry, id]
    parts: list[np.ndarray] = []
    if allowed_e:
        rows_np = np.asarray(allowed_e, dtype=np.int64)
        parts += [rows_np, *_flat(allowed_e, allowed_ids)]
    if banned_e:
        parts += _flat(banned_e, banned_ids)
    if bias_e:
        parts += _flat(bias_e, bias_ids)
    if not parts:
        return None
    out = TokenConstraints()
    flat = torch.from_numpy(np.concatenate(parts)).to(device, non_blocking=True)
    views = list(flat.split([len(p) for p in parts]))
    if allowed_e:
        out.allowed_rows = views.pop(0)
        out.allowed = (views.pop(0), views.pop(0))
    if banned_e:
        out.banned = (views.pop(0), views.pop(0))
    if bias_e:
        out.bias = (views.pop(0), views.pop(0))
        values = torch.from_numpy(np.concatenate(bias_v))
        out.bias_values = values.to(device, non_blocking=True)
    return out


def _flat(entries: list[int], ids: list[np.ndarray]) -> list[np.ndarray]:
    """[entry of each id, ids]: e.g. entries [0, 2], ids [[5, 9], [7]] -> [0, 0, 2], [5, 9, 7]."""
    counts = np.fromiter((len(a) for a in ids), dtype=np.int64, count=len(ids))
    return [np.repeat(np.asarray(entries, dtype=np.int64), counts), np.concatenate(ids)]
