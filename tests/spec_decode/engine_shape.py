"""The engine's shape for a proposer, shared by the n-gram and suffix tests: 256 running
requests with 2,000-token contexts, then 16 decode steps of one token each. Each context ends
by copying an earlier passage, so every draft is known; the time is printed, not asserted."""

from __future__ import annotations

import time

import numpy as np

from pagedllm.spec_decode import Proposer


def run_engine_shape(p: Proposer, rng: np.random.Generator, label: str) -> None:
    """Propose for 256 requests, then 16 steps, asserting each draft; finish them all."""
    contexts = []
    for _ in range(256):
        base = rng.integers(0, 32000, 1990).tolist()
        contexts.append(base + base[500:510])
    t0 = time.perf_counter()
    for i, ctx in enumerate(contexts):
        assert p.propose(str(i), ctx, 1000, 5) == ctx[510:515]
    t1 = time.perf_counter()
    for step in range(16):
        for i, ctx in enumerate(contexts):
            ctx.append(ctx[510 + step])
            assert p.propose(str(i), ctx, 1000, 5) == ctx[511 + step : 516 + step]
    t2 = time.perf_counter()
    print(f"{label}: first call {1e3 * (t1 - t0):.1f} ms, {1e3 * (t2 - t1) / 16:.1f} ms per step")
    for i, ctx in enumerate(contexts):
        p.finish(str(i), ctx, 1000)
