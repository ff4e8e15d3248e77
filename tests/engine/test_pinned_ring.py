"""``PinnedRing``: host int arrays reach the device through a ring of reused buffers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.utils.pinned import PinnedRing

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_every_copy_keeps_its_values_through_reuse_and_growth(device):
    """More copies than buffers, and arrays longer than a buffer: each tensor holds its own
    array's values after the buffers were reused and replaced."""
    ring = PinnedRing(torch.device(device), capacity=8, n=3, staged=True)
    rng = np.random.default_rng(0)
    sent = [rng.integers(-(2**40), 2**40, size=int(rng.integers(0, 30))) for _ in range(20)]
    got = [ring.ship(a) for a in sent]
    for a, t in zip(sent, got):
        assert t.device.type == device and t.dtype == torch.int64
        assert np.array_equal(t.cpu().numpy(), a)
    assert max(b.shape[0] for b in ring.buffers) >= max(len(a) for a in sent)


def test_without_staging_the_cpu_gets_the_array_itself():
    ring = PinnedRing(torch.device("cpu"), capacity=8)
    a = np.arange(5, dtype=np.int64)
    assert not ring.buffers
    assert np.shares_memory(ring.ship(a).numpy(), a)
