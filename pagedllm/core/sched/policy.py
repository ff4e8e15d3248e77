"""Scheduling policies: the order in which waiting requests are admitted and running requests
keep their place, and which running request is preempted first."""

from __future__ import annotations

import bisect
import itertools
from abc import ABC, abstractmethod

from pagedllm.core.request import Request


class SchedulingPolicy(ABC):
    """A policy ranks requests: lower rank is served first and preempted last."""

    name: str

    @abstractmethod
    def rank(self, request: Request) -> tuple:
        """Sort key of a request; ties broken by arrival order by the queues."""


class FCFSPolicy(SchedulingPolicy):
    """First come, first served: earlier arrival first; the latest arrival is preempted first."""

    name = "fcfs"

    def rank(self, request: Request) -> tuple:
        return (request.arrival_time,)


class RankedQueue:
    """Requests kept sorted by (policy rank, insertion number). Used for both the waiting
    queue and the running list, so that the running request preempted first is always the last
    one, which is also the one scheduled last in a step."""

    def __init__(self, policy: SchedulingPolicy) -> None:
        self.policy = policy
        self._keys: list[tuple] = []
        self._reqs: list[Request] = []
        self._counter = itertools.count()

    def add(self, request: Request) -> None:
        key = (self.policy.rank(request), next(self._counter))
        i = bisect.bisect_right(self._keys, key)
        self._keys.insert(i, key)
        self._reqs.insert(i, request)

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

    def __getitem__(self, i: int) -> Request:
        return self._reqs[i]

    def __len__(self) -> int:
        return len(self._reqs)

    def __iter__(self):  # noqa: ANN204
        return iter(list(self._reqs))

    def __contains__(self, request: object) -> bool:
        return request in self._reqs


def make_policy(name: str) -> SchedulingPolicy:
    if name == "fcfs":
        return FCFSPolicy()
    raise ValueError(f"scheduling_policy must be 'fcfs', got {name!r}.")
