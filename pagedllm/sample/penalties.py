"""Repetition, frequency and presence penalties, vectorized over the batch."""

from __future__ import annotations

import torch


def token_counts(token_ids: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[B, vocab] float32 counts of each token in each row's list."""
    counts = torch.zeros(len(token_ids), vocab_size, dtype=torch.float32, device=device)
    for i, ids in enumerate(token_ids):
        if ids:
            idx = torch.as_tensor(ids, dtype=torch.int64, device=device)
            counts[i].index_add_(0, idx, torch.ones(len(ids), device=device))
    return counts


def apply_penalties(
    logits: torch.Tensor,  # [B, vocab] float32, modified in place
    prompt_ids: list[list[int]],
    output_ids: list[list[int]],
    presence: torch.Tensor,  # [B]
    frequency: torch.Tensor,  # [B]
    repetition: torch.Tensor,  # [B]
) -> torch.Tensor:
    """vLLM's (and HF's) rules: repetition penalty divides positive logits and multiplies
    negative ones of every token seen in the prompt or the output; frequency subtracts
    count-in-output x penalty; presence subtracts penalty once for any token in the output."""
    vocab = logits.shape[1]
    out_counts = token_counts(output_ids, vocab, logits.device)
    seen = (token_counts(prompt_ids, vocab, logits.device) + out_counts) > 0
    rep = repetition[:, None].expand_as(logits)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen & (rep != 1.0), penalized, logits)
    logits = logits - frequency[:, None] * out_counts
    logits = logits - presence[:, None] * (out_counts > 0).float()
    return logits
