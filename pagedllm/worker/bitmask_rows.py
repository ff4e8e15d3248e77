"""The grammar bitmask of a step's structured requests, applied to its logits on the device."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from pagedllm.structured_output.grammars import GrammarStep


class BitmaskApplier:
    """Masks the sampled rows of structured requests; keeps the pinned row buffers (two: the
    last copy may be queued) and, on a GPU, the device buffers the mask and its rows are
    copied into (reused each step; the stream orders a step's copy after the last step's
    kernel read them)."""

    def __init__(self, device: torch.device, max_num_reqs: int) -> None:
        self.device = device
        self.max_num_reqs = max_num_reqs
        self._rows: list[torch.Tensor] = []
        self._turn = 0
        self._dev: tuple[torch.Tensor, torch.Tensor] | None = None

    def apply(self, logits: torch.Tensor, bitmask: GrammarStep, rows_np: np.ndarray) -> None:
        """Mask the sampled rows of structured requests (``rows_np``: the logits row of each
        mask row) in one vectorized operation; the mask and the row indices reach the device
        by non-blocking copies from pinned memory into preallocated device buffers."""
        from pagedllm.structured_output.bitmask import apply_token_bitmask

        mask = bitmask.mask  # [n, ceil(vocab / 32)] int32, host
        n = len(rows_np)
        assert mask is not None and n == mask.shape[0], "a mask row per sampling position"
        cuda = self.device.type == "cuda"
        if not self._rows or n > self._rows[0].shape[0]:
            # a row per sampling position: more than one per request with drafts
            max_rows = max(self.max_num_reqs, n)
            self._rows = [
                torch.empty(max_rows, dtype=torch.int64, pin_memory=cuda) for _ in range(2)
            ]
            if cuda:
                self._dev = (
                    torch.empty((max_rows, mask.shape[1]), dtype=torch.int32, device=self.device),
                    torch.empty(max_rows, dtype=torch.int64, device=self.device),
                )
        # rows_np is increasing (structured batch indices, searched in the sampling ones):
        # ending at n - 1 it is 0..n-1, e.g. every sampling row constrained -> no row indices
        rows = None
        if rows_np[-1] != n - 1:
            rows = self._rows[self._turn][:n]
            self._turn ^= 1
            rows.numpy()[:] = rows_np
        if self._dev is not None:
            mask_dev = self._dev[0][:n]
            mask_dev.copy_(mask, non_blocking=True)
            mask = mask_dev
            if rows is not None:
                rows = self._dev[1][:n].copy_(rows, non_blocking=True)
        apply_token_bitmask(logits, mask, rows)
