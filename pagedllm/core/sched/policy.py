"""Scheduling policies behind one small interface.

A policy ranks requests; lower ranks are served first. The waiting queue is ordered by
``waiting_rank`` (re-sorted each step when the rank depends on time), the running list by
``running_rank``: the running request ranked last is the first preempted.

- fcfs: by arrival. Preemption victim: the latest arrival.
- priority: by (priority, arrival), lower value first. A waiting request whose priority value
  is strictly lower than that of the worst running request may preempt it when memory or
  max_num_seqs is short (see ``Scheduler._preempt_for_priority``). Victim: the largest priority
  value, latest arrival among equals.
- sjf: shortest job first by the tokens the request still has to prefill (prompt tokens not in
  the prefix cache), with aging: rank = uncached_tokens - aging_rate x seconds waited. A job of
  L tokens outranks every newly arriving job (rank >= 1) after (L - 1) / aging_rate seconds, so
  its wait is bounded. Running requests keep FCFS order (victim: the latest arrival), so a
  short job never evicts work already in progress.
"""

from __future__ import annotations

import bisect
import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable

from pagedllm.core.request import Request


class SchedulingPolicy(ABC):
    """Ranks requests: lower is served first and preempted last."""

    name: str
    dynamic = False  # waiting ranks change with time: re-sort every step

    @abstractmethod
    def waiting_rank(self, request: Request, now: float) -> tuple:
        """Order of admission among waiting requests."""

    def running_rank(self, request: Request) -> tuple:
        """Order among running requests; the last is preempted first."""
        return (request.arrival_time,)

    def may_preempt_for(self, waiting: Request, running: Request) -> bool:
        """Whether ``waiting`` may take the place of ``running`` (priority policy only)."""
        return False


class FCFSPolicy(SchedulingPolicy):
    """First come, first served."""

    name = "fcfs"

    def waiting_rank(self, request: Request, now: float) -> tuple:
        return (request.arrival_time,)


class PriorityPolicy(SchedulingPolicy):
    """Lower ``priority`` value first; ties by arrival."""

    name = "priority"

    def waiting_rank(self, request: Request, now: float) -> tuple:
        return (request.priority, request.arrival_time)

    def running_rank(self, request: Request) -> tuple:
        return (request.priority, request.arrival_time)

    def may_preempt_for(self, waiting: Request, running: Request) -> bool:
        return waiting.priority < running.priority


class SJFPolicy(SchedulingPolicy):
    """Shortest (uncached) prefill first, aged by waiting time."""

    name = "sjf"
    dynamic = True

    def __init__(self, aging_rate: float, cached_tokens: Callable[[Request], int]) -> None:
        self.aging_rate = aging_rate
        self.cached_tokens = cached_tokens

    def waiting_rank(self, request: Request, now: float) -> tuple:
        todo = request.num_tokens - self.cached_tokens(request)
        return (todo - self.aging_rate * (now - request.arrival_time), request.arrival_time)


class Now:
    """A mutable timestamp (seconds, from the scheduler's clock) for the waiting queue's ranks:
    the queue's key closes over it, not over the scheduler (a cycle only the cyclic collector
    would free)."""

    __slots__ = ("value",)

    def __init__(self, value: float) -> None:
        self.value = value


class RankedQueue:
    """Requests kept sorted by (rank, insertion number)."""

    def __init__(self, key: Callable[[Request], tuple]) -> None:
        self.key = key
        self._keys: list[tuple] = []
        self._reqs: list[Request] = []
        self._counter = itertools.count()

    def add(self, request: Request) -> None:
        key = (self.key(request), next(self._counter))
        i = bisect.bisect_right(self._keys, key)
        self._keys.insert(i, key)
        self._reqs.insert(i, request)

    def resort(self) -> None:
        """Recompute every key (for ranks that change with time)."""
        pairs = sorted(((self.key(r), k[1]), r) for k, r in zip(self._keys, self._reqs))
        self._keys = [k for k, _ in pairs]
        self._reqs = [r for _, r in pairs]

    def peek(self) -> Request:
        return self._reqs[0]

    def pop_front(self) -> Request:
        self._keys.pop(0)
        return self._reqs.pop(0)

    def pop_back(self) -> Request:
        self._keys.pop()
        return self._reqs.pop()

    def remove(self, request: Request) -> None:
        i = self._reqs.index(request)
        del self._keys[i]
        del self._reqs[i]

    def index(self, request: Request) -> int:
        return self._reqs.index(request)

    def __getitem__(self, i: int) -> Request:
        return self._reqs[i]

    def __len__(self) -> int:
        return len(self._reqs)

    def __iter__(self):  # noqa: ANN204
        return iter(list(self._reqs))

    def __contains__(self, request: object) -> bool:
        return request in self._reqs


POLICIES = ("fcfs", "priority", "sjf")


def make_policy(
    name: str, aging_rate: float = 0.0, cached_tokens: Callable[[Request], int] | None = None
) -> SchedulingPolicy:
    if name == "fcfs":
        return FCFSPolicy()
    if name == "priority":
        return PriorityPolicy()
    if name == "sjf":
        return SJFPolicy(aging_rate, cached_tokens or (lambda r: 0))
    raise ValueError(f"scheduling_policy must be one of {POLICIES}, got {name!r}.")
