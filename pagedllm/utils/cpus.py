"""The CPU lists of ``--cpu-threads-bind``: their syntax and the CPUs each rank gets.

``bind``: ``"none"`` (the default: every usable CPU for every rank; on a small VM binding
each OpenMP thread to a core gains nothing), ``"auto"`` (the usable CPUs split into
``world`` equal consecutive slices, rank r takes slice r) or an explicit list per rank,
``"0-3|4-7"`` (ranges and single CPUs joined by commas, ranks by ``|``).

Example: usable CPUs 0-7, world 2, bind "auto" -> rank 0 on 0-3, rank 1 on 4-7;
bind "0,2|1,3" -> rank 0 on CPUs 0 and 2, rank 1 on 1 and 3.

``DeviceConfig`` checks the syntax when it is built (``check_bind``); each rank's process
applies its list (``worker/cpu_threads.py``).
"""

from __future__ import annotations

import os


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
