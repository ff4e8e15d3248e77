"""A profiler hook for benchmarks: CUDA events around each step's device work and around named
spans of it (KV-Compress evictions), attached with ``runner.profiler = DeviceTimer()`` (and
to a KV connector's worker role that times its own spans). Without it, nothing is recorded;
on a CPU it records nothing either (a step is done when its call returns)."""

from __future__ import annotations

from typing import Any

import torch


class DeviceTimer:
    """Device seconds per resolved step (``step_seconds``, in launch order) and per span
    (``span_seconds(name)``, with the index of the step each ran in: ``span_steps``)."""

    def __init__(self) -> None:
        self.step_seconds: list[float] = []
        self.steps_started = 0
        self._spans: dict[str, list[tuple[Any, Any, int]]] = {}

    @staticmethod
    def begin() -> Any:
        """A start event recorded now on the current stream (None off a GPU)."""
        if not torch.cuda.is_available():
            return None
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        return start

    @staticmethod
    def end(start: Any) -> tuple[Any, Any] | None:
        """(start, end) with an end event recorded now; None when ``start`` is None."""
        if start is None:
            return None
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        return start, end

    def begin_step(self) -> Any:
        """The start of a step's device work."""
        start = self.begin()
        self.steps_started += start is not None
        return start

    def step_resolved(self, timing: tuple[Any, Any] | None) -> None:
        """A timed step resolved: its device seconds (waits for its end event)."""
        if timing is not None:
            timing[1].synchronize()
            self.step_seconds.append(timing[0].elapsed_time(timing[1]) / 1e3)

    def add_span(self, name: str, timing: tuple[Any, Any] | None) -> None:
        """A named span of the step started last."""
        if timing is not None:
            self._spans.setdefault(name, []).append((*timing, self.steps_started - 1))

    def span_seconds(self, name: str) -> list[float]:
        """Device seconds of each ``name`` span (synchronizes)."""
        spans = self._spans.get(name, [])
        if spans:
            spans[-1][1].synchronize()
        return [a.elapsed_time(b) / 1e3 for a, b, _ in spans]

    def span_steps(self, name: str) -> list[int]:
        """The index (among the timed steps) of the step each ``name`` span ran in."""
        return [i for _, _, i in self._spans.get(name, [])]
