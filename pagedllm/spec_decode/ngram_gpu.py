"""Prompt lookup on the device ("ngram_gpu" in vLLM): the n-gram proposer of ``ngram.py`` as a
few batched tensor operations over the rows' token histories, so that drafts go from one step's
samples to the next step's inputs without passing through the host (the engine keeps
asynchronous steps while speculating; ``worker/device_drafts.py`` holds the histories).

The rule is ``ngram_propose``'s, row by row: for the largest n in [min_n, max_n] whose last n
tokens occur earlier in the row, the draft is the k tokens that followed the most recent such
occurrence (it may overlap the suffix; at the row's end it repeats with the match's period).
No Python loop over the rows or the context: the work is ``[rows, width]`` comparisons, once
per n.
"""

from __future__ import annotations

import torch


def ngram_propose_rows(
    hist: torch.Tensor, lens: torch.Tensor, min_n: int, max_n: int, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts for each row of ``hist``; ``(drafts, num_valid)``.

    ``hist``: ``[R, W]`` int token histories; row r's tokens are ``hist[r, :lens[r]]`` (``W``
    at least the longest; what lies past a row's length is never read). ``lens``: ``[R]``
    int64, at least 1. Returns ``drafts`` ``[R, k]`` (same dtype as ``hist``; 0 for a row
    without a match) and ``num_valid`` ``[R]`` int64 (k or 0): row r's draft is
    ``drafts[r, :num_valid[r]]``, what ``ngram_propose(hist[r, :lens[r]], min_n, max_n, k)``
    returns.

    Example (min_n 2, max_n 3, k 2), a row [1, 2, 3, 4, 9, 2, 3, 8, 1, 2, 3] (len 11): the last
    token (3, at 10) occurs at e = 2 and 6; matching backwards, e = 2 matches 3 tokens, e = 6
    matches 2 -> n = 3, e = 2 -> drafts [4, 9], num_valid 2.
    """
    num_rows, width = hist.shape
    device = hist.device
    lens = lens.to(torch.int64)
    last = lens - 1  # [R] the position of each row's last token
    cols = torch.arange(width, device=device)  # [W]
    # an earlier occurrence ends at e < last; at most n = min(max_n, len - 1) tokens compare
    cap = torch.clamp(last, max=max_n)  # [R]
    rows = torch.arange(num_rows, device=device)
    running = cols[None, :] < last[:, None]  # [R, W] candidates still matching
    match_len = torch.zeros(num_rows, width, dtype=torch.int64, device=device)  # [R, W]
    for j in range(max_n):
        # suffix token j (read backwards) against the token j before each candidate end:
        # hist[r, e - j] == hist[r, last - j]
        suffix_j = hist[rows, torch.clamp(last - j, min=0)]  # [R]
        if j == 0:
            shifted = hist
        else:
            shifted = torch.nn.functional.pad(hist, (j, 0), value=-1)[:, :width]  # [R, W]
        running = running & (shifted == suffix_j[:, None]) & (j < cap)[:, None]
        match_len += running
    n = match_len.max(dim=1).values  # [R] the longest match
    ok = (n >= min_n) & (n >= 1)  # [R]
    # the most recent end among the longest: e.g. match_len [3, 0, 2, 3] -> n 3 -> e = 3
    best = torch.where(match_len == n[:, None], cols[None, :], -1).max(dim=1).values  # [R]
    # draft i at best + 1 + i % period: e.g. last 4, best 1 (period 3), k 5 -> 2, 3, 4, 2, 3
    period = torch.clamp(last - best, min=1)  # [R]
    idx = best[:, None] + 1 + torch.arange(k, device=device)[None, :] % period[:, None]
    valid = ok[:, None].expand(-1, k)  # [R, k]
    drafts = torch.gather(hist, 1, torch.clamp(idx, 0, width - 1))
    drafts = torch.where(valid, drafts, torch.zeros_like(drafts))
    return drafts, valid.sum(dim=1)
