"""Threads and cores of the CPU path: ``--cpu-threads`` and ``--cpu-threads-bind``.

vLLM's CPU backend binds its OpenMP threads to cores (``VLLM_CPU_OMP_THREADS_BIND``); here the
binding restricts each rank's process to a set of CPUs (``os.sched_setaffinity``: the threads
created after it - torch's OpenMP pool is created at the first parallel region - inherit it),
and the thread count (``torch.set_num_threads``) defaults to that set's size. The lists'
syntax and which CPUs a rank gets: ``utils/cpus.py``.

Example: usable CPUs 0-7, world 2, bind "auto" -> rank 0 on 0-3, rank 1 on 4-7, 4 threads
each. The world is every rank of every data-parallel core (``host_rank``): cores that each
took every CPU oversubscribed the host (a tiny model's DP 2 on 2 CPUs ran 6-60x slower).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from pagedllm.utils.cpus import cpus_for_rank

if TYPE_CHECKING:
    from pagedllm.config import DeviceConfig


def apply_cpu_threads(device_config: DeviceConfig, rank: int, world: int) -> int:
    """Bind this process (see the module docstring) and set torch's thread count:
    ``cpu_threads`` when given, else the bound CPUs' count, else (several ranks sharing the
    host, no ``OMP_NUM_THREADS``) the usable CPUs divided among the ranks. Returns the thread
    count torch uses afterwards."""
    import torch

    threads = device_config.cpu_threads
    cpus = cpus_for_rank(device_config.cpu_threads_bind, rank, world)
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    if threads is None and cpus is not None:
        threads = len(cpus)
    if threads is None and world > 1 and "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, len(os.sched_getaffinity(0)) // world)
    if threads is not None:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def host_rank(parallel_config: Any, tp_rank: int) -> tuple[int, int]:
    """(rank, world) of a tensor-parallel rank among every rank of every data-parallel core
    on this host: the cores share its CPUs as their ranks do. Example: data parallelism 2,
    tensor parallelism 2: core 1's rank 0 is rank 2 of 4."""
    pc = parallel_config
    tp = pc.tensor_parallel_size
    return pc.data_parallel_rank * tp + tp_rank, pc.data_parallel_size * tp
