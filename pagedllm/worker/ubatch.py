"""Dual-batch overlap (``--enable-dbo``): a step's batch as two micro-batches whose MoE
exchanges hide behind each other's compute.

Under expert parallelism over data-parallel cores every MoE layer waits for two collectives,
the gather of every core's rows and the reduce-scatter of the sums
(``distributed/expert_parallel.py``). With two micro-batches, ``a`` (the first requests of
the batch) and ``b`` (the rest), each runs its forward pass in a thread of its own, one thread
at a time (``distributed/turns.py``): a micro-batch that has started a collective hands the
turn to the other and waits for its transfer only when the turn comes back. So while
``a``'s tokens travel, ``b`` computes its attention or experts, and the other way round:

    a: attn0 | gather ~~~~~~~~~~~~ | experts0 | scatter ~~~~~~~~~~~~ | attn1 ...
    b:          attn0 | gather ~~~~~~~~~~~~~ | experts0 | scatter ~~~~~~~~~~ ...

The order of the collectives is the same on every core (a's gather, b's gather, a's scatter,
b's scatter, then the next layer), as long as every core runs both micro-batches: a core
with fewer tokens (or none) still runs two, possibly empty. Torch ops release the GIL: on a
CPU the other thread computes while gloo's threads move the data; on a GPU the kernels of
both go to the same stream in turn order, and the NCCL transfers run on NCCL's stream.

The cores agree on whether a step overlaps (``engine/dp_sync.py``): only if every core with
tokens has two requests or more and at least the threshold's tokens.
"""

from __future__ import annotations

from typing import Any

from pagedllm.distributed.turns import run_overlapped


def ubatch_split(n_sched: list[int]) -> int:
    """How many of a batch's requests (in batch order) form micro-batch ``a``: the fewest
    whose tokens reach half the batch's, leaving ``b`` at least one request (0 for a batch of
    fewer than two). Example: [1, 1, 1, 1] -> 2; [100, 1, 1] -> 1; [1, 1, 100] -> 2."""
    if len(n_sched) < 2:
        return 0
    total, acc = sum(n_sched), 0
    for i, n in enumerate(n_sched[:-1]):
        acc += n
        if 2 * acc >= total:
            return i + 1
    return len(n_sched) - 1


def forward_overlapped(runner: Any, rows: Any, n_sched: Any, ubatches: Any) -> Any:
    """The forward pass of a step's rows as two overlapped micro-batches (``ubatch_split``
    of its requests); ``ubatches``: every core's tokens in a and b (agreed). The hidden
    states ``[num_tokens, hidden]`` in batch order."""
    import torch

    from pagedllm.distributed.expert_parallel import set_step_tokens

    r = ubatch_split([int(n) for n in n_sched])
    parts = [(rows[:r], n_sched[:r]), (rows[r:], n_sched[r:])]
    inputs = [runner.inputs.prepare(rs, ns) for rs, ns in parts]

    def run(i: int) -> Any:
        set_step_tokens(ubatches[i])
        return runner._forward(inputs[i])

    a, b = run_overlapped(lambda: run(0), lambda: run(1))
    return torch.cat([a, b])


def idle_overlapped(model: Any, ubatches: Any) -> None:
    """A core with no tokens in an overlapped step: both micro-batches' MoE exchanges, with
    zero rows of its own, taking turns as the other cores' micro-batches do."""
    from pagedllm.distributed.expert_parallel import set_step_tokens

    def run(i: int) -> None:
        set_step_tokens(ubatches[i])
        model.dp_idle_forward()

    run_overlapped(lambda: run(0), lambda: run(1))
