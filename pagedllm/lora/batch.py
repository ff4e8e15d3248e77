"""``LoRABatch``: which adapter slot each token of the step uses, in the two forms the LoRA
layers read - groups of token indices per slot (the CPU's path) and the Triton kernels'
``meta`` buffer (tokens sorted by slot, each slot's start and count: ``pagedllm/ops/lora.py``).

The meta buffer is static (one device tensor for the engine's life, written before each
forward pass with a device-side copy), so a CUDA graph captured with the LoRA kernels reads
the step's grouping at replay; padding tokens of a graph belong to no slot.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.lora.ops import Groups
from pagedllm.utils.pinned import PinnedRing


def segments(token_slots: np.ndarray, max_loras: int) -> tuple[np.ndarray, ...]:
    """(token ids sorted by slot, each slot's start in that order, its count); tokens of slot
    -1 are left out. Example (2 slots): [1, -1, 0, 1] -> [2, 0, 3], [0, 1], [1, 2]."""
    slots = np.asarray(token_slots, dtype=np.int64)
    order = np.argsort(slots, kind="stable")
    order = order[slots[order] >= 0]
    counts = np.bincount(slots[order], minlength=max_loras)
    return order, np.cumsum(counts) - counts, counts


class LoRABatch:
    """The step's tokens by adapter slot (see the module docstring); one object shared by the
    LoRA layers of a model and set once per step by ``LoRAWorker.prepare``."""

    def __init__(self, max_loras: int, max_num_tokens: int, device: torch.device) -> None:
        self.max_loras = max_loras
        self.max_num_tokens = max_num_tokens
        self.device = device
        self.cuda = device.type == "cuda"
        self.groups: Groups = []
        # [max_num_tokens + 2 * max_loras] int64: sorted token ids | starts | counts
        self.meta = torch.zeros(max_num_tokens + 2 * max_loras, dtype=torch.int64, device=device)
        self._ring = PinnedRing(device, self.meta.numel()) if self.cuda else None

    def set(self, token_slots: np.ndarray) -> None:
        """Group the step's tokens by slot ([T] slots, -1 for the base model). Example
        (2 slots): [1, -1, 0, 1] -> groups [(0, [2]), (1, [0, 3])]; meta [2, 0, 3, ... | 0, 1
        | 1, 2]."""
        if len(token_slots) > self.max_num_tokens:
            raise ValueError(f"{len(token_slots)} tokens, more than {self.max_num_tokens}")
        order, starts, counts = segments(token_slots, self.max_loras)
        present = np.nonzero(counts)[0]
        if not self.cuda:
            self.groups = [
                (int(k), torch.from_numpy(order[starts[k] : starts[k] + counts[k]].copy()))
                for k in present
            ]
            return
        self.groups = [(int(k), torch.empty(0)) for k in present]  # (the slots; rows unused)
        L, M = self.max_loras, self.max_num_tokens
        host = np.concatenate([order, starts, counts])
        assert self._ring is not None
        shipped = self._ring.ship(host)  # [n + 2L] on the device
        n = len(order)
        self.meta[:n].copy_(shipped[:n])
        self.meta[M : M + 2 * L].copy_(shipped[n:])
