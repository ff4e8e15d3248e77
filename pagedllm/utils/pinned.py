"""Host <-> device copies that never wait for the device: small int arrays to it
(``PinnedRing``), results back from it (``copy_to_host``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def copy_to_host(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], Any]:
    """Start copying device tensors to fresh pinned host tensors, without a host sync; returns
    them and a CUDA event recorded after the copies (read them once it has completed). Off a
    GPU the tensors are already on the host: returned as they are, with no event."""
    if not tensors or tensors[0].device.type != "cuda":
        return tensors, None
    host = []
    for t in tensors:
        h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        h.copy_(t, non_blocking=True)
        host.append(h)
    event = torch.cuda.Event()
    event.record()
    return host, event


class PinnedRing:
    """Copies of 1-D int arrays to the device as int64 tensors, each through the next of
    ``n`` host buffers (pinned on a GPU), reused once the copy out of it has completed -
    long done by then; a buffer too small for an array is replaced by one twice its size.

    Why: a copy from pageable memory waits for the work queued before it (under async
    scheduling, the last step), so the steps would run one at a time; and
    ``Tensor.pin_memory()`` per copy allocates pinned memory each time, a host cost paid on
    every step. On a CPU the array itself is returned (as int64), unless ``staged`` (tests:
    the ring's path without a GPU)."""

    def __init__(
        self, device: torch.device, capacity: int, n: int = 16, staged: bool | None = None
    ) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        staged = self.cuda if staged is None else staged
        self.buffers: list[torch.Tensor] = []
        self.copied: list[torch.cuda.Event | None] = []
        self.turn = 0
        if staged:
            self.buffers = [
                torch.empty(max(capacity, 1), dtype=torch.int64, pin_memory=self.cuda)
                for _ in range(n)
            ]
            self.copied = [None] * n

    def ship(self, host: np.ndarray) -> torch.Tensor:
        """``host`` (1-D, integers) as an int64 tensor on the device. Example: [3, 1, 2] ->
        tensor([3, 1, 2]) on the device, its buffer free again once the copy has run."""
        if not self.buffers:
            return torch.from_numpy(np.ascontiguousarray(host, dtype=np.int64))
        turn = self.turn
        self.turn = (turn + 1) % len(self.buffers)
        if self.copied[turn] is not None:
            self.copied[turn].synchronize()
        n = int(host.shape[0])
        if n > self.buffers[turn].shape[0]:
            self.buffers[turn] = torch.empty(2 * n, dtype=torch.int64, pin_memory=self.cuda)
        buf = self.buffers[turn]
        buf.numpy()[:n] = host
        out = buf[:n].to(self.device, non_blocking=True)
        if self.cuda:
            event = self.copied[turn] = torch.cuda.Event()
            event.record()
        else:
            out = out.clone()  # (the same device: ``to`` returned the buffer's view)
        return out
