"""Threads and cores of the CPU path: ``--cpu-threads`` and ``--cpu-threads-bind``.

vLLM's CPU backend binds its OpenMP threads to cores (``VLLM_CPU_OMP_THREADS_BIND``); here the
binding restricts each rank's process to a set of CPUs (``os.sched_setaffinity``: the threads
created after it - torch's OpenMP pool is created at the first parallel region - inherit it),
and the thread count (``torch.set_num_threads``) defaults to that set's size.

``bind``: ``"none"`` (the default: every usable CPU for every rank; on a small VM binding
each OpenMP thread to a core gains nothing), ``"auto"`` (the usable CPUs split into
``world`` equal consecutive slices, rank r takes slice r) or an explicit list per rank,
``"0-3|4-7"`` (ranges and single CPUs joined by commas, ranks by ``|``).

Example: usable CPUs 0-7, world 2, bind "auto" -> rank 0 on 0-3, rank 1 on 4-7, 4 threads
each; bind "0,2|1,3" -> rank 0 on CPUs 0 and 2, rank 1 on 1 and 3.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.config import DeviceConfig


def parse_cpu_list(text: str) -> list[int]:
    """``"0-3,8"`` -> [0, 1, 2, 3, 8]; ValueError naming ``cpu_threads_bind`` otherwise."""
    cpus: list[int] = []
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()) or (sep and int(hi) < int(lo)):
            raise ValueError(
                f"cpu_threads_bind: {text!r} is not a CPU list such as '0-3' or '0,2,4'."
            )
        cpus.extend(range(int(lo), int(hi) + 1) if sep else [int(lo)])
    return sorted(set(cpus))


def check_bind(bind: str) -> None:
    """Validate ``cpu_threads_bind`` at configuration time (its lists' syntax)."""
    if bind in ("none", "auto"):
        return
    for rank_list in bind.split("|"):
        parse_cpu_list(rank_list)


def cpus_for_rank(bind: str, rank: int, world: int) -> list[int] | None:
    """The CPUs rank ``rank`` of ``world`` is bound to, or None (no binding)."""
    if bind == "none":
        return None
    if bind == "auto":
        usable = sorted(os.sched_getaffinity(0))
        per = max(1, len(usable) // world)
        return usable[rank * per : (rank + 1) * per] or usable
    lists = bind.split("|")
    if len(lists) != world:
        raise ValueError(
            f"cpu_threads_bind {bind!r} gives {len(lists)} CPU lists for {world} ranks "
            "(one per tensor-parallel rank, joined by '|')."
        )
    return parse_cpu_list(lists[rank])


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
