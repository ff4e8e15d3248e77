"""Where a loop's time goes, logged now and then (``PAGEDLLM_LOOP_STATS=SECONDS``).

The engine core process and the server's front end each keep one: wall time split into named
phases (waiting for input, commands, steps, sends; handling the core's messages vs the rest
of the event loop), reported as fractions of the interval with the count of steps. Off (the
default), a lap costs one ``perf_counter`` call and an addition.
"""

from __future__ import annotations

import logging
import os
import time

logger = logging.getLogger(__name__)


def stats_interval() -> float | None:
    """Seconds between reports (``PAGEDLLM_LOOP_STATS``), or None when off."""
    value = os.environ.get("PAGEDLLM_LOOP_STATS")
    try:
        return float(value) if value else None
    except ValueError:
        return None


class LoopClock:
    """Accumulates the time since the previous ``lap`` into the named phase."""

    def __init__(self, name: str, phases: tuple[str, ...]) -> None:
        self.name = name
        self.interval = stats_interval()
        self.totals = dict.fromkeys(phases, 0.0)
        self.count = 0
        self._last = self._start = time.perf_counter()
        self._cpu = time.process_time()

    def lap(self, phase: str, count: bool = False) -> None:
        """Charge the time since the last lap to ``phase`` (``count``: one more step)."""
        now = time.perf_counter()
        self.totals[phase] += now - self._last
        self._last = now
        self.count += count
        if self.interval is not None and now - self._start >= self.interval:
            self.report(now)

    def report(self, now: float) -> None:
        span = now - self._start
        cpu = time.process_time()
        parts = ", ".join(f"{k} {100 * v / span:.0f}%" for k, v in self.totals.items())
        logger.info(
            "%s loop, last %.1f s: %d steps; %s; process CPU %.0f%%",
            self.name, span, self.count, parts, 100 * (cpu - self._cpu) / span,
        )  # fmt: skip
        self.totals = dict.fromkeys(self.totals, 0.0)
        self.count = 0
        self._start, self._cpu = now, cpu
