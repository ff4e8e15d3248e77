"""Prompt lookup ("ngram" in vLLM): guess that the text repeats what followed an earlier copy of
its last n tokens.

For n from ``prompt_lookup_max`` down to ``prompt_lookup_min``: if the last n tokens occur
earlier in the request's tokens (prompt and output so far), the draft is the k tokens that
followed the most recent earlier occurrence; the first (largest) n that matches wins. Where
those run into the end of the tokens (the occurrence is fewer than k tokens back: a period
shorter than k), the draft goes on copying its own start, as the text would if it kept
repeating - vLLM's prompt lookup stops there instead (e.g. ``[1, 1, 1]`` drafts ``[1]`` there,
``[1, 1, 1, 1]`` here with k 4): loops of a few tokens, as in lists, tables and degenerate
outputs, then verify k drafts a step. Each
request keeps its tokens in a numpy buffer grown by the tokens that arrived since the last
call; one lookup is a vectorized scan for the last token plus a check of the n - 1 before it at
those places (no Python loop over the context).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.proposer import check_k


def ngram_propose(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """The ``k`` tokens that followed the most recent earlier occurrence of the longest suffix
    of ``tokens`` of n tokens, ``min_n <= n <= max_n``; ``[]`` when none occurs.

    ``tokens``: ``[num_tokens]`` int array (prompt + output so far). The earlier occurrence may
    overlap the suffix itself (periodic text); where the draft reaches the end of ``tokens`` it
    repeats with the period P = (the last position) - (the occurrence's end): draft i is
    ``tokens[end + 1 + i % P]``. Example: [5, 6, 7, 5, 6], n = 2: the occurrence ends at 1,
    P = 3 -> k 5 drafts [7, 5, 6, 7, 5].

    Example (min_n=2, max_n=3, k=2), tokens = [1, 2, 3, 4, 9, 2, 3, 8, 1, 2, 3]:
    the last token 3 occurs earlier where it ends at e = [2, 6]. Matching backwards from there
    against the suffix (3, 2, 1): e=2 matches 3 tokens ([1, 2, 3] at 0..2), e=6 matches 2
    ([9, 2, 3] differs in its first). The longest n is 3, its most recent occurrence ends at
    e=2, so the draft is tokens[3:5] = [4, 9] (the more recent 2-gram [2, 3] at 5..6, followed
    by [8, 1], loses to the longer match).
    """
    num_tokens = int(tokens.shape[0])
    max_n = min(max_n, num_tokens - 1)  # an earlier occurrence ends at num_tokens - 2 at most
    if k <= 0 or max_n < min_n or max_n < 1:
        return []
    last = num_tokens - 1
    ends = np.flatnonzero(tokens[:last] == tokens[last])  # [num_candidates] ascending
    if ends.size == 0:
        return []
    offsets = np.arange(max_n)  # [max_n]
    idx = ends[:, None] - offsets[None, :]  # [num_candidates, max_n] positions compared
    suffix = tokens[last - offsets]  # [max_n] the suffix read backwards
    equal = (tokens[np.maximum(idx, 0)] == suffix[None, :]) & (idx >= 0)
    # match length per candidate: its first mismatch, or max_n if none
    match_len = np.where(equal.all(axis=1), max_n, equal.argmin(axis=1))  # [num_candidates]
    n = int(match_len.max())
    if n < min_n:
        return []
    end = int(ends[np.flatnonzero(match_len == n)[-1]])  # the most recent of the longest
    return tokens[end + 1 + np.arange(k) % (last - end)].tolist()


class _TokenBuffer:
    """One request's tokens in a numpy array that doubles when full."""

    __slots__ = ("array", "size")

    def __init__(self) -> None:
        self.array = np.empty(256, dtype=np.int64)  # [capacity]
        self.size = 0

    def sync(self, token_ids: Sequence[int]) -> None:
        """Append the tokens of ``token_ids`` past ``size``; start over if they shrank or the
        last token seen changed (the tokens were not a continuation)."""
        n = len(token_ids)
        size = self.size
        if n < size or (size and int(token_ids[size - 1]) != int(self.array[size - 1])):
            size = 0
        if n == size:
            self.size = size
            return
        try:
            new = np.asarray(token_ids[size:], dtype=np.int64)  # [n - size]
        except (TypeError, ValueError, OverflowError):
            raise ValueError("token_ids must be integer token ids.") from None
        if n > self.array.shape[0]:
            grown = np.empty(max(n, 2 * self.array.shape[0]), dtype=np.int64)
            grown[:size] = self.array[:size]
            self.array = grown
        self.array[size:n] = new
        self.size = n

    @property
    def tokens(self) -> np.ndarray:
        return self.array[: self.size]  # [size]


class NgramProposer:
    """vLLM's "ngram" method (prompt lookup decoding), one token buffer per request.

    Per call: O(new tokens) to grow the buffer, then one vectorized pass over the context for
    the last token and a ``[occurrences, prompt_lookup_max]`` comparison. Memory: 8 bytes per
    context token per running request (at most twice that, from the doubling).
    """

    def __init__(self, config: SpeculativeConfig) -> None:
        if config.method not in ("ngram", "ngram_gpu"):
            raise ValueError(f"NgramProposer needs method 'ngram', got {config.method!r}.")
        self.min_n = int(config.prompt_lookup_min)  # type: ignore[arg-type]
        self.max_n = int(config.prompt_lookup_max)  # type: ignore[arg-type]
        self.num_speculative_tokens = config.num_speculative_tokens
        self._buffers: dict[str, _TokenBuffer] = {}

    def propose(
        self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int, k: int
    ) -> list[int]:
        """The ``k`` tokens that followed the most recent earlier copy of the longest suffix of
        ``token_ids`` (``prompt_lookup_min`` to ``prompt_lookup_max`` tokens; repeating where
        they reach the end, see ``ngram_propose``); ``[]`` if none."""
        k = check_k(k)
        buf = self._buffers.get(req_id)
        if buf is None:
            buf = _TokenBuffer()
            buf.sync(token_ids)  # may raise: then nothing is kept for req_id
            self._buffers[req_id] = buf
        else:
            buf.sync(token_ids)
        return ngram_propose(buf.tokens, self.min_n, self.max_n, k)

    def finish(self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        """Drop the request's buffer."""
        self._buffers.pop(req_id, None)

    @property
    def num_requests(self) -> int:
        """Requests with state here (proposed for and not finished)."""
        return len(self._buffers)
