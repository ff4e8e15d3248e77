"""Prompt logprobs: the logprob of each prompt token given the ones before it, read off the
hidden states of the step's prompt chunk."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from pagedllm.worker.input_batch import InputBatch


def prompt_logprobs(
    model: torch.nn.Module,
    ib: InputBatch,
    req_ids: list[str],
    rows: np.ndarray,
    hidden: torch.Tensor,
    qsl: np.ndarray,
    seq_lens: np.ndarray,
) -> dict:
    """Logprobs of prompt tokens 1.. (token p+1 is predicted at position p), chunk by
    chunk: a chunk over positions [s, e) yields tokens s+1 .. min(e, prompt_len - 1)."""
    result: dict = {}
    if not ib.num_prompt_logprobs:  # the common case: nobody asked, skip the loop
        return result
    for i, rid in enumerate(req_ids):
        row = int(rows[i])
        p = ib.sampling_params[row]
        if p is None or p.prompt_logprobs is None:
            continue
        start = int(seq_lens[i] - (qsl[i + 1] - qsl[i]))
        end = min(int(seq_lens[i]), int(ib.num_prompt_tokens[row]) - 1)
        if end <= start:
            continue
        h = hidden[int(qsl[i]) : int(qsl[i]) + (end - start)]
        lp = model.compute_logits(h).log_softmax(dim=-1)  # [n, vocab]
        targets = torch.from_numpy(ib.token_ids[row, start + 1 : end + 1]).to(lp.device)
        tgt_lp = lp.gather(1, targets[:, None])
        tgt_rank = (lp > tgt_lp).sum(-1, keepdim=True) + 1
        n = p.prompt_logprobs
        if n > 0:
            top_lp, top_ids = lp.topk(n, dim=-1)
            rk = torch.arange(1, n + 1, device=lp.device).expand(len(targets), n)
            ids = torch.cat([targets[:, None], top_ids], 1).tolist()
            lps = torch.cat([tgt_lp, top_lp], 1).tolist()
            ranks = torch.cat([tgt_rank, rk], 1).tolist()
        else:
            ids, lps, ranks = targets[:, None].tolist(), tgt_lp.tolist(), tgt_rank.tolist()
        result[rid] = (start + 1, list(zip(ids, lps, ranks)))
    return result
