"""Expert parallelism over data-parallel engine cores: the group of the cores' MoE layers.

With ``data_parallel_size`` N and ``enable_expert_parallel``, each engine core (one rank of
attention, its own scheduler and KV cache) holds E / N whole experts of every MoE layer, and
the cores' MoE layers exchange tokens each forward pass (vLLM's "allgather_reducescatter"
dispatch and combine):

1. dispatch: every core's tokens, padded to the step's largest count ``T_max``, are gathered
   on every core: ``[N * T_max, H]`` (``dp_gather``);
2. each core routes every gathered row and computes the pairs of its own experts (the other
   pairs are "not here", see ``layers/moe.py``), padding rows none;
3. combine: a reduce-scatter sums the cores' partial outputs and hands each core its own
   ``T_max`` rows (``dp_reduce_scatter``), of which it keeps its ``T``.

Every core must run the same collectives in the same order: the engine cores agree on each
step before it runs (``engine/dp_sync.py``: every core's token count, so ``T_max`` is known
before the forward pass), and a core with nothing to compute still joins each MoE layer's
exchange with zero rows (``ModelRunner.execute_dp_idle``).

Example (N = 2, T = [3, 1]): T_max = 3; core 1 pads its row to 3; the gather gives 6 rows,
rows 4 and 5 padding; core 0 computes its experts' pairs of rows 0..3, core 1 its own experts'
pairs of the same rows; the reduce-scatter gives core 0 rows 0..2 and core 1 rows 3..5, of
which core 1 keeps row 3.

Without a group (``dp_ep_info()`` (0, 1)) the MoE block takes its one-rank path and
nothing here is called.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import torch

COLLECTIVE_TIMEOUT_S = 120
_rank, _size = 0, 1
_backend = "allgather_reducescatter"


class _StepState(threading.local):
    """Per thread: dual-batch overlap runs each micro-batch in a thread of its own."""

    counts: tuple[int, ...] = ()  # each core's tokens in this (micro-)batch
    valid: torch.Tensor | None = None  # [N * T_max] bool: the gathered rows that are tokens


_step = _StepState()


def init_dp_expert_parallel(rank: int, size: int, init_method: str, device_type: str) -> None:
    """Join the group of ``size`` engine cores as ``rank`` (NCCL on GPUs, gloo on CPUs).
    A process of the group runs tensor parallelism of 1: the group is its default group."""
    global _rank, _size
    if size > 1:
        import torch.distributed as dist

        dist.init_process_group(
            "nccl" if device_type == "cuda" else "gloo",
            init_method=init_method,
            rank=rank,
            world_size=size,
            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
    _rank, _size = rank, size


def join_from_config(parallel_config: Any, device_type: str) -> None:
    """Join the cores' group if ``parallel_config`` shares the experts over data-parallel
    cores (``ParallelConfig.dp_expert_parallel``; the front end set the rank and port)."""
    global _backend
    pc = parallel_config
    if pc.dp_expert_parallel:
        _backend = pc.all2all_backend
        init_dp_expert_parallel(
            pc.data_parallel_rank,
            pc.data_parallel_size,
            f"tcp://127.0.0.1:{pc.data_parallel_master_port}",
            device_type,
        )


def all2all_backend() -> str:
    """How the MoE layers exchange tokens: "allgather_reducescatter" (the module docstring's
    steps) or "alltoallv" (each token only to the cores of its experts:
    ``layers/moe.py``'s ``_dispatch_combine``, over ``dp_exchange_rows``)."""
    return _backend


def dp_ep_info() -> tuple[int, int]:
    """(this core's rank, the number of cores) of the group; (0, 1) without one."""
    return _rank, _size


def set_step_tokens(counts: tuple[int, ...] | list[int]) -> None:
    """Every core's token count of the (micro-)batch about to run on this thread (the same
    list on every core)."""
    _step.counts = tuple(int(c) for c in counts)
    _step.valid = None


def _wait(work: Any) -> None:
    """Wait for an asynchronous collective; under dual-batch overlap the other micro-batch
    runs first (``distributed/turns.py``: its compute overlaps this transfer)."""
    from pagedllm.distributed.turns import yield_to_other

    yield_to_other()
    work.wait()


def dp_gather(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This core's rows ``x [T, H]`` -> every core's rows ``[N * T_max, H]`` (each core's
    block padded with zeros to ``T_max``) and which of them are tokens ``[N * T_max]``."""
    import torch.distributed as dist

    counts = _step.counts
    t_max = max(counts)
    t, h = x.shape
    assert t == counts[_rank], (t, counts)
    padded = x if t == t_max else torch.cat([x, x.new_zeros(t_max - t, h)])
    out = x.new_empty(_size * t_max, h)
    # (torch 2.13 renames all_gather_into_tensor all_gather_single)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    _wait(gather(out, padded.contiguous(), async_op=True))
    if _step.valid is None or _step.valid.device != x.device:
        # Example: counts [3, 1] -> [T, T, T, T, F, F]
        rows = torch.arange(t_max).repeat(_size) < torch.tensor(counts).repeat_interleave(t_max)
        _step.valid = rows.to(x.device)
    return out, _step.valid


def dp_reduce_scatter(y: torch.Tensor) -> torch.Tensor:
    """The cores' partial outputs of the gathered rows ``[N * T_max, H]`` summed, this core's
    rows of them ``[T, H]``."""
    import torch.distributed as dist

    t_max = y.shape[0] // _size
    out = y.new_empty(t_max, y.shape[1])
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    _wait(scatter(out, y.contiguous(), async_op=True))
    return out[: _step.counts[_rank]]


def dp_exchange_rows(
    tensors: list[torch.Tensor], send_counts: torch.Tensor, recv_counts: torch.Tensor | None = None
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """All-to-all of rows with uneven splits: each tensor's first ``send_counts[c]`` rows go
    to core 0's... in core order (``[sum(send_counts), ...]``); what every core sent this one,
    in core order, and the counts received ``[N]`` (exchanged first unless given). The
    splits are read on the host: a device sync per call."""
    import torch.distributed as dist

    if recv_counts is None:
        recv_counts = torch.empty_like(send_counts)
        _wait(dist.all_to_all_single(recv_counts, send_counts, async_op=True))
    send, recv = send_counts.tolist(), recv_counts.tolist()
    outs = []
    for t in tensors:
        out = t.new_empty(sum(recv), *t.shape[1:])
        work = dist.all_to_all_single(out, t.contiguous(), recv, send, async_op=True)
        _wait(work)
        outs.append(out)
    return outs, recv_counts
