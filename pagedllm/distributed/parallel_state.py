"""The tensor-parallel group of this process and the collectives the layers use.

A worker of the multiprocess executor joins the group once, before its model is built
(``init_tensor_parallel``): torch.distributed with NCCL on GPUs and gloo on CPUs, one rank per
worker process. Layers read ``tp_info()`` when they are built (to size their shards) and call
``all_reduce`` / ``all_gather`` in their forward pass. A process that never joins a group
(the in-process executor, tests of single layers) is rank 0 of 1 and every collective is the
identity.
"""

from __future__ import annotations

from datetime import timedelta

import torch

COLLECTIVE_TIMEOUT_S = 120
_rank, _world = 0, 1


def init_tensor_parallel(rank: int, world: int, init_method: str, device_type: str) -> None:
    """Join the group of ``world`` ranks as ``rank`` (``init_method``: "tcp://host:port" of
    rank 0's store). NCCL on a GPU, gloo on a CPU. A world of 1 needs no group."""
    global _rank, _world
    if world > 1:
        import torch.distributed as dist

        backend = "nccl" if device_type == "cuda" else "gloo"
        # a rank that waits on a dead peer fails after this, not after 30 minutes (the
        # executor notices a dead worker much sooner and stops the others)
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
    _rank, _world = rank, world


def tp_info() -> tuple[int, int]:
    """(rank, world size) of this process's tensor-parallel group; (0, 1) without one."""
    return _rank, _world


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of ``x`` over the ranks, in place (the identity on one rank)."""
    if _world > 1:
        import torch.distributed as dist

        dist.all_reduce(x)
    return x


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """The ranks' ``x`` side by side along the last dimension, rank 0's first.

    Example: 2 ranks, x [3, 4] each -> [3, 8], columns 0..3 from rank 0."""
    if _world == 1:
        return x
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(_world)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
