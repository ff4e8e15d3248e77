"""A KV-Compress probe for the quality benchmark, attached through the KV seam
(``pagedllm/core/sched/connector.py``), not through engine fields: teacher forcing at a prompt
token, and a log of every eviction's KVs.

A request with ``SamplingParams(extra_args={"compress_at": c}, prompt_logprobs=0, ...)`` and a
budget computes its first ``c`` prompt tokens, is evicted there (the chunk's last queries
score the keys, as a prompt's last chunk does), and its remaining prompt tokens - and their
prompt logprobs - see the compressed cache; it is never evicted again. Every eviction of
every request is logged as (request id, KVs before, KVs after) in the planner's ``log``
(compressible heads, its shared cached prefix included), e.g.
``llm.llm_engine.engine_core.scheduler.connectors[-1].log`` (KV-Compress's role: last).

Use: ``with measured_prefix(): llm = LLM(..., enable_kvc=True); llm.generate(...)`` (the
engine's KV-Compress scheduler role is this subclass while the block runs; in-process
engines only, as the quality benchmark runs).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

from pagedllm.core.request import Request
from pagedllm.core.sched.connector import scheduler_role_swapped
from pagedllm.core.sched.kvc import KVCompressPlanner


def _compress_at(request: Request) -> int | None:
    extra = request.sampling_params.extra_args or {}
    at = extra.get("compress_at")
    return int(at) if at is not None else None


class MeasuredPrefixPlanner(KVCompressPlanner):
    """KV-Compress's planner, evicting a ``compress_at`` request once, at that token, and
    logging every eviction."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.log: list[tuple[str, int, int]] = []

    def _kvs(self, rid: str) -> int:
        return self.kvm.held_kvs(rid) + self.kvm.prefix_tokens(rid) * self.num_heads

    def update(self, metadata: Any, output: Any) -> None:
        evicted = [e.req_id for e in metadata.evictions] if metadata is not None else []
        live = [rid for rid in evicted if rid in self.inflight]
        before = {rid: self._kvs(rid) for rid in live}
        super().update(metadata, output)
        self.log += [(rid, before[rid], self._kvs(rid)) for rid in live]

    def add_request(self, request: Request) -> None:
        super().add_request(request)
        if _compress_at(request) is not None:
            self.budgeted.add(request.request_id)

    def num_new_tokens(self, request: Request, num_new: int) -> int:
        """A chunk ends at the request's ``compress_at`` token (evicted after it)."""
        at = _compress_at(request)
        if at is not None and request.num_computed_tokens < at:
            return min(num_new, at - request.num_computed_tokens)
        return num_new

    def eviction_due(self, request: Request, after: int) -> bool:
        at = _compress_at(request)
        if at is None:
            return super().eviction_due(request, after)
        track = self.tracks[request.request_id]
        if after == at and track.compressed_at < 0:
            track.compressed_at = after  # evicted now, then never
            return True
        return False

    def window_scored(self, request: Request, after: int) -> bool:
        return after == _compress_at(request)


def measured_prefix() -> AbstractContextManager[None]:
    """KV-Compress's scheduler role is ``MeasuredPrefixPlanner`` inside the block."""
    return scheduler_role_swapped("kvcompress", f"{__name__}:MeasuredPrefixPlanner")
