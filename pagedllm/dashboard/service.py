"""The dashboard's data on the server side: a history of the engine's numbers (one sample a
second, the last ten minutes) and the engine snapshot (``engine/snapshot.py``), fetched from
the engine core at a bounded rate and only while someone looks.

Costs, by design:
- nobody looking: one sample a second of numbers the front end already has (the stats that
  come with every step's outputs, the Prometheus counters); the engine core does nothing;
- viewers connected (any number): one snapshot per period (``hz``, at most ``MAX_HZ`` a
  second) built by the core between two steps and shared by every viewer; ``/dashboard/state``
  reuses a snapshot younger than ``1 / MAX_HZ`` s;
- whatever the rate asked, the period is at least the last snapshot's build time over
  ``CORE_BUDGET``: snapshots never take more than 0.5% of the core's time (a pool of millions
  of blocks refreshes less often; ``period_s`` in the state says how often).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from pagedllm.engine.snapshot import engine_snapshot

logger = logging.getLogger(__name__)

MAX_HZ = 4.0  # snapshots a second, whatever the viewers ask
DEFAULT_HZ = 2.0
HISTORY_S = 600  # seconds of history kept (one sample a second)
CORE_BUDGET = 0.005  # the most of the core's time snapshots may take


def _rate(new: dict, old: dict | None, key: str, dt: float) -> float | None:
    """Per-second growth of a cumulative counter between two samples."""
    if old is None or dt <= 0 or key not in new or key not in old:
        return None
    return max(0.0, (new[key] - old[key]) / dt)


class DashboardService:
    """History and snapshots for the dashboard's routes (``dashboard/routes.py``)."""

    def __init__(
        self,
        async_llm: Any,
        metrics: Any,
        hz: float = DEFAULT_HZ,
        stopping: Callable[[], bool] = lambda: False,
    ) -> None:
        self.async_llm = async_llm
        self.stopping = stopping  # the server is draining: event streams end
        self.metrics = metrics
        if isinstance(hz, bool) or not isinstance(hz, (int, float)) or not hz > 0:
            raise ValueError(f"dashboard_hz must be a positive number (snapshots a second), "
                             f"got {hz!r}.")  # fmt: skip
        self.hz = min(float(hz), MAX_HZ)
        self.history: collections.deque[dict[str, Any]] = collections.deque(maxlen=HISTORY_S)
        self._last_raw: dict[str, Any] | None = None
        self._snapshot: dict[str, Any] | None = None
        self._snapshot_at = 0.0  # monotonic time of the snapshot's fetch
        self._fetch: asyncio.Future | None = None  # the fetch in flight, shared
        self._tasks: list[asyncio.Task] = []
        self.viewers = 0
        self.version = 0  # snapshots fetched so far
        self.closed = False
        self.started = time.time()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the history sampler (on the server's event loop)."""
        self._tasks.append(asyncio.create_task(self._sample_history()))

    async def close(self) -> None:
        """End the sampler and every event stream (the server is stopping or draining)."""
        self.closed = True
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()

    # -------------------------------------------------------------------- history
    async def _sample_history(self) -> None:
        while not self.closed:
            try:
                self.sample()
            except Exception:  # a sample must never end the sampler
                logger.exception("dashboard: history sample failed")
            await asyncio.sleep(1.0)

    def sample(self) -> dict[str, Any]:
        """Append one history point: gauges as they are, counters as rates since the last."""
        stats = self.async_llm.stats()
        raw = {
            "t": time.time(),
            "steps": stats.get("num_steps", 0),
            "step_s": stats.get("step_seconds", 0.0),
            "gen": self._counter("vllm:generation_tokens_total"),
            "prompt": self._counter("vllm:prompt_tokens_total"),
            "queries": stats.get("prefix_cache_queries", 0),
            "hits": stats.get("prefix_cache_hits", 0),
            "preempt": stats.get("num_preemptions", 0),
            "drafts": stats.get("spec_decode_num_draft_tokens", 0),
            "accepted": stats.get("spec_decode_num_accepted_tokens", 0),
            "evicted": stats.get("kvc_evicted_kvs", 0),
        }
        old = self._last_raw
        dt = raw["t"] - old["t"] if old is not None else 0.0
        d_steps = raw["steps"] - old["steps"] if old is not None else 0
        d_q = raw["queries"] - old["queries"] if old is not None else 0
        d_drafts = raw["drafts"] - old["drafts"] if old is not None else 0
        point = {
            "t": round(raw["t"], 3),
            "kv_usage": round(float(stats.get("kv_cache_usage", 0.0)), 4),
            "running": stats.get("num_running_reqs", 0),
            "waiting": stats.get("num_waiting_reqs", 0),
            "gen_tok_s": _rate(raw, old, "gen", dt),
            "prompt_tok_s": _rate(raw, old, "prompt", dt),
            "steps_s": _rate(raw, old, "steps", dt),
            "step_ms": (raw["step_s"] - old["step_s"]) / d_steps * 1e3 if d_steps > 0 else None,
            "busy": _rate(raw, old, "step_s", dt),
            "prefix_hit": (raw["hits"] - old["hits"]) / d_q if d_q > 0 else None,
            "preempt_s": _rate(raw, old, "preempt", dt),
            "spec_accept": (raw["accepted"] - old["accepted"]) / d_drafts
            if d_drafts > 0 else None,
            "evicted_s": _rate(raw, old, "evicted", dt),
        }  # fmt: skip
        self._last_raw = raw
        self.history.append(point)
        return point

    def _counter(self, name: str) -> float:
        value = self.metrics.registry.get_sample_value(
            name, {"model_name": self.metrics.model_name}
        )
        return float(value or 0.0)

    # ------------------------------------------------------------------ snapshots
    @property
    def min_period(self) -> float:
        """The shortest time between two snapshots: ``1 / MAX_HZ``, or longer when the last
        one took more than ``CORE_BUDGET`` of that."""
        build_s = self._snapshot["build_ms"] / 1e3 if self._snapshot is not None else 0.0
        return max(1.0 / MAX_HZ, build_s / CORE_BUDGET)

    async def snapshot(self, max_age: float | None = None) -> dict[str, Any]:
        """A snapshot of the engine no older than ``max_age`` s (default and at least
        ``min_period``): the last one, or a new one fetched from the core (one fetch at a
        time, shared)."""
        max_age = max(max_age or 0.0, self.min_period)
        if self._snapshot is not None and time.monotonic() - self._snapshot_at < max_age:
            return self._snapshot
        if self._fetch is None:
            self._fetch = asyncio.ensure_future(self._fetch_snapshot())
        fetch = self._fetch
        return await asyncio.shield(fetch)

    async def _fetch_snapshot(self) -> dict[str, Any]:
        try:
            cores = await self.async_llm.call_in_cores(engine_snapshot)
            snap = dict(cores[0])
            snap["cores"] = len(cores)
            if len(cores) > 1:  # data parallel: core 0's map, every core's table and counts
                snap["requests"] = [r for c in cores for r in c["requests"]]
                snap["stats"] = {**snap["stats"], **self.async_llm.stats()}
            self._snapshot, self._snapshot_at = snap, time.monotonic()
            self.version += 1
            return snap
        finally:
            self._fetch = None

    def state(self, snap: dict[str, Any], since: float | None = None) -> dict[str, Any]:
        """What the page and ``/dashboard/state`` get: the snapshot, the server's facts and
        the history (the points after ``since``, a wall time, when given)."""
        hist = list(self.history)
        if since is not None:
            hist = [p for p in hist if p["t"] > since]
        return {
            "model": self.metrics.model_name,
            "server_started": self.started,
            "version": self.version,
            "hz": self.hz,
            "period_s": max(1.0 / self.hz, self.min_period),
            "snapshot": snap,
            "history": hist,
        }

    async def events(self, hz: float | None = None) -> AsyncIterator[bytes]:
        """Server-sent events: a full state first, then each new snapshot with the history
        points since the last event, at most ``hz`` a second (capped at ``MAX_HZ``), until
        the server closes the dashboard or the client goes."""
        asked = 1.0 / min(max(hz or self.hz, 0.1), MAX_HZ)
        self.viewers += 1
        try:
            since: float | None = None
            while not self.closed and not self.stopping():
                t0 = time.monotonic()
                period = max(asked, self.min_period)
                try:
                    snap = await self.snapshot(max_age=period / 2)
                except Exception as e:  # the engine is gone or busy failing: say so, go on
                    yield b"event: engine-error\ndata: " + to_json({"error": str(e)}) + b"\n\n"
                    await asyncio.sleep(1.0)
                    continue
                state = self.state(snap, since)
                if state["history"]:
                    since = state["history"][-1]["t"]
                yield b"data: " + to_json(state) + b"\n\n"
                await asyncio.sleep(max(0.0, period - (time.monotonic() - t0)))
        finally:
            self.viewers -= 1


def to_json(obj: Any) -> bytes:
    """Compact JSON; a non-finite number (which JSON cannot carry) becomes null."""
    try:
        return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
    except ValueError:
        return json.dumps(_finite(obj), separators=(",", ":"), allow_nan=False).encode()


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj
