"""LoRA's shrink and expand in PyTorch: the CPU's path and the reference of the Triton kernels
(``pagedllm/ops/lora.py``), on the same operands.

A step's tokens come grouped by adapter slot (``LoRABatch.groups``: (slot, row indices) for
each slot present; tokens of the base model, slot -1, are in no group). Per group, in float32:
``s = x[rows] @ A[slot]^T`` ([n, S * R], S sub-projections of R columns each), then for each
sub-projection k ``out[rows, off_k : off_k + size_k] += s[:, kR : (k+1)R] @ B[slot, off_k :
off_k + size_k]^T`` (a loop over the adapters present, not over tokens).
"""

from __future__ import annotations

import torch

Groups = list[tuple[int, torch.Tensor]]  # (slot, [n] token indices)


def lora_shrink_ref(x: torch.Tensor, a: torch.Tensor, groups: Groups, rank: int) -> torch.Tensor:
    """[T, K] x and [L, S * R, K] slots' A -> [S, T, R] float32 (zero for tokens in no
    group)."""
    num_subs = a.shape[1] // rank
    s = torch.zeros((x.shape[0], a.shape[1]), dtype=torch.float32, device=x.device)
    for slot, rows in groups:
        s[rows] = x[rows].float() @ a[slot].float().T  # [n, S * R]
    return s.view(x.shape[0], num_subs, rank).transpose(0, 1)


def lora_expand_ref(
    s: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    groups: Groups,
    subs: list[tuple[int, int]],
) -> None:
    """``out`` [T, N] += [S, T, R] ``s`` times each group's slot's B [L, N, R], sub-projection
    k into columns ``subs[k]`` = (offset, size)."""
    for slot, rows in groups:
        for k, (off, size) in enumerate(subs):
            delta = s[k, rows] @ b[slot, off : off + size].float().T  # [n, size]
            out[rows, off : off + size] += delta.to(out.dtype)
