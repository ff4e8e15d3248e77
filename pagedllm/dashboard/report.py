"""The dashboard as a file: frames of the engine's state recorded during an offline run
(``pagedllm bench throughput --kv-map-report report.html``), written as one self-contained
HTML page (the dashboard's own script and style inlined, a slider over the frames; nothing
fetched when it opens).

``FrameRecorder(core, every_s)`` takes ``engine_snapshot(core)`` after a step once at least
``every_s`` seconds have passed since the last (and after the last step, at ``finish``): the
run's timings include these snapshots (``build_ms`` in each frame says what each cost).
"""

from __future__ import annotations

import html
import json
import time
from pathlib import Path
from typing import Any

from pagedllm.dashboard import STATIC
from pagedllm.engine.snapshot import engine_snapshot

MAX_FRAMES = 400  # a longer run keeps every other frame, then every fourth, ...


class FrameRecorder:
    """Snapshots of an in-process ``EngineCore`` during a run (see the module docstring)."""

    def __init__(self, core: Any, every_s: float = 0.5, max_cells: int = 2048) -> None:
        if not every_s > 0:
            raise ValueError(f"the report's frame interval must be > 0 s, got {every_s!r}.")
        self.core = core
        self.every_s = every_s
        self.max_cells = max_cells
        self.frames: list[dict[str, Any]] = []
        self._last = 0.0
        self._step = core.step

        def step(*args: Any, **kwargs: Any) -> Any:
            out = self._step(*args, **kwargs)
            if time.monotonic() - self._last >= self.every_s:
                self.take()
            return out

        core.step = step  # (an instance attribute: only this core, only while recording)

    def take(self) -> None:
        """One frame now."""
        self._last = time.monotonic()
        self.frames.append(engine_snapshot(self.core, self.max_cells))
        if len(self.frames) > MAX_FRAMES:
            self.frames = self.frames[::2]

    def finish(self) -> list[dict[str, Any]]:
        """Stop recording (the core's own ``step`` again) after a last frame; the frames."""
        self.take()
        del self.core.step
        return self.frames


def history_of(frames: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The dashboard's history points from consecutive frames: gauges as they are, step time
    and steps per second from the core's counters (no token counters offline: null)."""
    points = []
    for i, f in enumerate(frames):
        s = f["stats"]
        p: dict[str, Any] = {
            "t": f["time"], "kv_usage": s.get("kv_cache_usage", 0.0),
            "running": s.get("num_running_reqs", 0), "waiting": s.get("num_waiting_reqs", 0),
            "gen_tok_s": None, "prompt_tok_s": None, "step_ms": None, "steps_s": None,
        }  # fmt: skip
        if i:
            prev = frames[i - 1]
            d_steps = f["num_steps"] - prev["num_steps"]
            dt = f["time"] - prev["time"]
            if d_steps > 0:
                p["step_ms"] = (f["step_seconds"] - prev["step_seconds"]) / d_steps * 1e3
            if dt > 0:
                p["steps_s"] = d_steps / dt
        points.append(p)
    return points


def write_report(path: str | Path, frames: list[dict[str, Any]], model: str) -> Path:
    """Write the frames as one HTML page (the dashboard's page, offline); its path."""
    if not frames:
        raise ValueError("a report needs at least one frame.")
    points = history_of(frames)
    states = [{"model": model, "version": i + 1, "hz": 0, "period_s": None,
               "snapshot": {**f, "cores": 1},
               "history": points[: i + 1]} for i, f in enumerate(frames)]  # fmt: skip
    page = (STATIC / "index.html").read_text()
    css = (STATIC / "dashboard.css").read_text()
    js = (STATIC / "dashboard.js").read_text()
    data = json.dumps(states, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")
    page = page.replace('<link rel="stylesheet" href="/dashboard/static/dashboard.css">',
                        f"<style>\n{css}</style>")  # fmt: skip
    page = page.replace('<script src="/dashboard/static/dashboard.js"></script>',
                        f"<script>window.PAGEDLLM_FRAMES = {data};</script>\n"
                        f"<script>\n{js.replace('</', '<' + chr(92) + '/')}</script>")  # fmt: skip
    page = page.replace("<title>pagedllm dashboard</title>",
                        f"<title>pagedllm report: {html.escape(model)}</title>")  # fmt: skip
    out = Path(path)
    out.write_text(page)
    return out
