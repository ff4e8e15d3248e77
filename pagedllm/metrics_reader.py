"""The offline API's metrics (``LLM.get_metrics()``), shaped like vLLM's metrics reader:
a list of ``Counter``, ``Gauge`` and ``Vector`` values under vLLM's metric names, read from
the engine's counters (no Prometheus needed).

Example, the mean acceptance length of speculative decoding (what vLLM's docs compute):

    m = {x.name: x for x in llm.get_metrics()}
    drafts = m["vllm:spec_decode_num_drafts"].value
    accepted = m["vllm:spec_decode_num_accepted_tokens"].value
    mean_acceptance_length = 1 + accepted / drafts

(the same value is in ``pagedllm:spec_decode_mean_acceptance_length``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Metric:
    """A metric's name and labels."""

    name: str
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Counter(Metric):
    """A cumulative count."""

    value: int = 0


@dataclass(frozen=True)
class Gauge(Metric):
    """A value at the time of reading."""

    value: float = 0.0


@dataclass(frozen=True)
class Vector(Metric):
    """Counts indexed by position (e.g. drafts accepted at each position)."""

    values: list[int] = field(default_factory=list)


_COUNTERS = {
    "num_preemptions": "vllm:num_preemptions",
    "prefix_cache_queries": "vllm:prefix_cache_queries",
    "prefix_cache_hits": "vllm:prefix_cache_hits",
    "num_steps": "pagedllm:engine_steps",
    "kvc_compressions": "pagedllm:kvc_compressions",
    "kvc_evicted_kvs": "pagedllm:kvc_evicted_kvs",
    "spec_decode_num_drafts": "vllm:spec_decode_num_drafts",
    "spec_decode_num_draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
}
_GAUGES = {
    "num_running_reqs": "vllm:num_requests_running",
    "num_waiting_reqs": "vllm:num_requests_waiting",
    "kv_cache_usage": "vllm:kv_cache_usage_perc",
    "num_free_blocks": "pagedllm:kv_cache_free_blocks",
    "num_blocks": "pagedllm:kv_cache_total_blocks",
}


def metrics_from_stats(stats: dict[str, Any]) -> list[Metric]:
    """The metrics of an engine core's ``stats()``; speculative decoding's only when it is on,
    with the mean acceptance length (1 + accepted / drafts: tokens per verifying step)."""
    out: list[Metric] = []
    for key, name in _COUNTERS.items():
        if key in stats:
            out.append(Counter(name, value=int(stats[key])))
    for key, name in _GAUGES.items():
        if key in stats:
            out.append(Gauge(name, value=float(stats[key])))
    per_pos = stats.get("spec_decode_num_accepted_tokens_per_pos")
    if per_pos is not None:
        out.append(Vector("vllm:spec_decode_num_accepted_tokens_per_pos", values=list(per_pos)))
        drafts = int(stats.get("spec_decode_num_drafts", 0))
        accepted = int(stats.get("spec_decode_num_accepted_tokens", 0))
        mean = 1 + accepted / drafts if drafts else 0.0
        out.append(Gauge("pagedllm:spec_decode_mean_acceptance_length", value=mean))
    return out
