"""Replaying a stream of timed requests through an LLMEngine and measuring each one."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from pagedllm.sampling_params import SamplingParams


@dataclass
class TimedRequest:
    """A request arriving ``arrival`` seconds after the start of the replay."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float = 0.0
    priority: int = 0
    kind: str = ""


@dataclass
class RequestTiming:
    """Latencies of one request, in seconds from its arrival."""

    request_id: str
    kind: str
    ttft: float
    latency: float
    num_output_tokens: int
    num_cached_tokens: int
    token_ids: list[int] = field(default_factory=list)


def replay(engine, requests: list[TimedRequest]) -> tuple[list[RequestTiming], float]:  # noqa: ANN001
    """Add each request when its arrival time comes and step the engine until all finish.
    Returns the timings and the wall time of the whole replay."""
    pending = sorted(requests, key=lambda r: r.arrival)
    by_id = {r.request_id: r for r in requests}
    first: dict[str, float] = {}
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    done: list[RequestTiming] = []
    start = time.perf_counter()
    i = 0
    while i < len(pending) or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while i < len(pending) and pending[i].arrival <= now:
            r = pending[i]
            engine.add_request(
                r.request_id,
                {"prompt_token_ids": r.prompt_token_ids},
                r.params,
                priority=r.priority,
                output_kind="delta",
            )
            i += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[i].arrival - (time.perf_counter() - start)))
            continue
        for out in engine.step():
            t = time.perf_counter() - start
            rid = out.request_id
            new = out.outputs[0].token_ids
            if new and rid not in first:
                first[rid] = t
            tokens[rid].extend(new)
            if out.finished:
                r = by_id[rid]
                done.append(
                    RequestTiming(
                        rid,
                        r.kind,
                        first.get(rid, t) - r.arrival,
                        t - r.arrival,
                        len(tokens[rid]),
                        out.num_cached_tokens,
                        tokens[rid],
                    )
                )
    return done, time.perf_counter() - start


def summarize(timings: list[RequestTiming]) -> dict:
    """Mean / p50 / p99 / max of TTFT and latency."""
    if not timings:
        return {}
    ttft = np.array([t.ttft for t in timings])
    lat = np.array([t.latency for t in timings])
    return {
        "count": len(timings),
        "ttft_mean_s": float(ttft.mean()),
        "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_p99_s": float(np.percentile(ttft, 99)),
        "latency_mean_s": float(lat.mean()),
        "latency_p50_s": float(np.percentile(lat, 50)),
        "latency_p99_s": float(np.percentile(lat, 99)),
        "latency_max_s": float(lat.max()),
    }
