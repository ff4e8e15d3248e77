"""Prometheus metrics of the server, exported at ``GET /metrics``.

Naming: every metric that vLLM also has is exported under vLLM's own name (``vllm:...``), with
vLLM's ``model_name`` label, so existing vLLM dashboards, alerts and benchmark scripts work
unchanged. Metrics that only pagedllm has use the ``pagedllm:`` prefix. No metric is exported
twice under both prefixes (that would double every series and invite dashboards to mix them).

vLLM names: ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc`` (0..1), ``vllm:num_preemptions_total``,
``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``,
``vllm:request_success_total{finished_reason}``, ``vllm:prefix_cache_queries_total``,
``vllm:prefix_cache_hits_total``, histograms ``vllm:time_to_first_token_seconds``,
``vllm:time_per_output_token_seconds``, ``vllm:e2e_request_latency_seconds``,
``vllm:request_prompt_tokens``, ``vllm:request_generation_tokens``; with speculative decoding
``vllm:spec_decode_num_drafts_total`` (request-steps that verified drafts),
``vllm:spec_decode_num_draft_tokens_total``, ``vllm:spec_decode_num_accepted_tokens_total`` and
``vllm:spec_decode_num_accepted_tokens_per_pos_total{position}`` (drafts accepted at position
0, 1, ...): accepted / drafts + 1 is the mean acceptance length. A server without speculation
exports none of them.

pagedllm names: ``pagedllm:kv_cache_free_blocks``, ``pagedllm:kv_cache_total_blocks`` (so a
probe can check that every block came back), ``pagedllm:engine_steps_total``; with a mixture of
experts ``pagedllm:moe_expert_pairs_total{expert}`` ((token, expert) pairs each expert computed,
summed over the MoE layers: the load per expert; read from the device at most once a second),
and with expert parallelism over data-parallel cores ``pagedllm:dp_idle_steps_total`` (steps a
core joined with no tokens of its own) and ``pagedllm:dbo_steps_total`` (steps run as two
overlapped micro-batches).

``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total`` count prompt tokens
looked up in / found in the prefix cache when a request is admitted (the scheduler's
cumulative ``prefix_cache_queries`` / ``prefix_cache_hits``, exported as they grow); hits over
queries is the hit rate. ``vllm:generation_tokens_total`` counts the tokens of every sequence
of a request (n > 1, best_of); a beam search counts its returned hypotheses when it ends.

Every metric lives in a per-server ``CollectorRegistry`` (not the process-global one), so
several servers can run in one process (tests). Counters and histograms are updated on the
engine thread after each iteration (prometheus-client is thread-safe); ``prompt_tokens_total``
counts a request's prompt when its first output arrives (prefill done) or when it ends.
"""

from __future__ import annotations

import time
from typing import Any

import prometheus_client
from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE_LATEST
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pagedllm.outputs import RequestOutput

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
_TPOT_BUCKETS = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
    7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


# (stats key, metric name, help) of the counters made when the engine first reports them
_SPEC_COUNTERS = (
    ("spec_decode_num_drafts", "vllm:spec_decode_num_drafts",
     "Request-steps that verified draft tokens."),
    ("spec_decode_num_draft_tokens", "vllm:spec_decode_num_draft_tokens",
     "Draft tokens verified."),
    ("spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens",
     "Draft tokens accepted."),
)  # fmt: skip
_OFFLOAD_COUNTERS = (
    ("offload_hit_tokens", "pagedllm:kv_offload_hits", "Tokens loaded from the host KV tier."),
    ("offload_queried_tokens", "pagedllm:kv_offload_queries",
     "Tokens looked up in the host KV tier."),
    ("offload_saved_blocks", "pagedllm:kv_offload_saved_blocks",
     "Blocks copied to the host KV tier."),
    ("offload_bytes_moved", "pagedllm:kv_offload_bytes",
     "Bytes copied to and from the host KV tier."),
    ("offload_copy_host_s", "pagedllm:kv_offload_copy_seconds",
     "Host time of the tier's copies."),
)  # fmt: skip


_TRANSFER_COUNTERS = (
    ("kv_transfer_sent", "pagedllm:kv_transfer_sent",
     "Prompts whose KV this engine handed over (a KV producer)."),
    ("kv_transfer_received_tokens", "pagedllm:kv_transfer_received_tokens",
     "Prompt tokens whose KV came from a producer instead of being computed."),
    ("kv_transfer_refused", "pagedllm:kv_transfer_refused",
     "Requests refused because their KV transfer was missing, truncated or foreign."),
    ("kv_transfer_send_failures", "pagedllm:kv_transfer_send_failures",
     "KV transfers this engine could not write."),
    ("kv_transfer_buffered", "pagedllm:kv_transfer_buffered",
     "KV transfers whose rows went through this producer's buffer (kv_buffer_size), not a file."),
    ("kv_transfer_bytes", "pagedllm:kv_transfer_bytes",
     "Bytes of KV written to and read from transfers."),
    ("kv_transfer_load_s", "pagedllm:kv_transfer_load_seconds",
     "Host time of reading transfers into the KV cache (the steps wait for it)."),
    ("kv_transfer_save_s", "pagedllm:kv_transfer_save_seconds",
     "Host time of writing transfers."),
)  # fmt: skip


_DP_COUNTERS = (
    ("dp_idle_steps", "pagedllm:dp_idle_steps",
     "Steps a data-parallel core joined with no tokens of its own (expert parallelism)."),
    ("dbo_steps", "pagedllm:dbo_steps", "Steps run as two overlapped micro-batches."),
)  # fmt: skip


class ServerMetrics:
    """The server's Prometheus metrics; ``record`` is an ``AsyncLLM`` stat logger."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        prometheus_client.disable_created_metrics()  # no *_created series (vLLM does the same)
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        reg = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=reg)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, labels + list(extra), registry=reg)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=reg)

        self.running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage (1 = 100 percent).")
        self.free_blocks = gauge("pagedllm:kv_cache_free_blocks", "Free KV-cache blocks.")
        self.total_blocks = gauge("pagedllm:kv_cache_total_blocks", "KV-cache blocks in all.")
        # Counter names are given without "_total": prometheus-client appends it.
        self.preemptions = counter("vllm:num_preemptions", "Cumulative preemptions.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generation tokens processed.")
        self.success = counter(
            "vllm:request_success", "Finished requests by reason.", ("finished_reason",)
        )
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prefix-cache queried tokens.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix-cache hit tokens.")
        self.steps = counter("pagedllm:engine_steps", "Engine iterations that ran the model.")
        self.kvc_compressions = counter(
            "pagedllm:kvc_compressions", "KV-Compress evictions (one per request compressed)."
        )
        self.kvc_evicted = counter("pagedllm:kvc_evicted_kvs", "KVs evicted by KV-Compress.")
        # speculative decoding's counters: made when the engine first reports them (a server
        # without speculation exports none of them, as vLLM)
        self._counter = counter
        self._lazy: dict[str, list[tuple[str, Counter]]] = {}  # (the host KV tier's too)
        self.spec_accepted_pos: Counter | None = None
        self.expert_pairs: Counter | None = None  # a mixture of experts' (made when reported)
        self.ttft = hist(
            "vllm:time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS
        )
        self.tpot = hist(
            "vllm:time_per_output_token_seconds", "Time per output token.", _TPOT_BUCKETS
        )
        self.e2e = hist(
            "vllm:e2e_request_latency_seconds", "End-to-end request latency.", _LATENCY_BUCKETS
        )
        # where a first token waited: the front end's hand-off to the engine core, the
        # scheduler's queue, and from the first scheduling to the token at the front end
        self.handoff = hist(
            "pagedllm:request_handoff_time_seconds",
            "Time from the front end accepting a request to the engine core queuing it.",
            _LATENCY_BUCKETS,
        )
        self.queue_time = hist(
            "vllm:request_queue_time_seconds", "Time in the scheduler's waiting queue.",
            _LATENCY_BUCKETS,
        )  # fmt: skip
        self.prefill_time = hist(
            "vllm:request_prefill_time_seconds",
            "Time from the first scheduling to the first token at the front end.",
            _LATENCY_BUCKETS,
        )
        self.req_prompt = hist(
            "vllm:request_prompt_tokens", "Prompt tokens per request.", _TOKEN_BUCKETS
        )
        self.req_gen = hist(
            "vllm:request_generation_tokens", "Generation tokens per request.", _TOKEN_BUCKETS
        )
        self._children: dict[tuple[Any, ...], Any] = {}
        # every series exists (at 0) from the start, as vLLM's do: a counter that has not
        # moved yet still has a value, not only its HELP and TYPE lines
        for metric in (
            self.running, self.waiting, self.kv_usage, self.free_blocks, self.total_blocks,
            self.preemptions, self.prompt_tokens, self.generation_tokens, self.prefix_queries,
            self.prefix_hits, self.steps, self.kvc_compressions, self.kvc_evicted, self.ttft,
            self.tpot, self.e2e, self.req_prompt, self.req_gen, self.handoff, self.queue_time,
            self.prefill_time,
        ):  # fmt: skip
            self._l(metric)
        for reason in ("stop", "length", "abort"):
            self._l(self.success, finished_reason=reason)
        self._last: dict[str, float] = {}
        self._counted_prompts: set[str] = set()
        self._num_tokens: dict[str, dict[int, int]] = {}  # request -> sequence index -> tokens

    def _lazy_counters(
        self, name: str, stats: dict[str, Any], specs: tuple[tuple[str, str, str], ...]
    ) -> list[tuple[str, Counter]]:
        """(stats key, counter) of a feature's counters, made (at 0) the first time the
        engine's stats carry the first key of ``specs`` ((stats key, metric name, help));
        [] while they do not (a server without the feature exports none, as vLLM)."""
        made = self._lazy.get(name)
        if made is None:
            if specs[0][0] not in stats:
                return []
            made = self._lazy[name] = [(k, self._counter(m, h)) for k, m, h in specs]
            for _, metric in made:
                self._l(metric)
        return made

    def _spec_counters(self, stats: dict[str, Any]) -> list[tuple[str, Counter]]:
        """Speculative decoding's counters (``_lazy_counters``), and the per-position one."""
        made = self._lazy_counters("spec", stats, _SPEC_COUNTERS)
        if made and self.spec_accepted_pos is None:
            self.spec_accepted_pos = self._counter(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                "Draft tokens accepted at each position of a draft.",
                ("position",),
            )
        return made

    def _l(self, metric: Any, **extra: str) -> Any:
        """The metric's child for this model (and ``extra`` labels), looked up once:
        ``labels()`` costs ~1 us, and ``record`` runs for every engine step."""
        key = (id(metric), *extra.values())
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(model_name=self.model_name, **extra)
        return child

    def record(self, stats: dict[str, Any], outputs: list[RequestOutput]) -> None:
        """Update every metric from one engine iteration (called on the engine thread)."""
        self._l(self.running).set(stats.get("num_running_reqs", 0))
        self._l(self.waiting).set(stats.get("num_waiting_reqs", 0))
        self._l(self.kv_usage).set(stats.get("kv_cache_usage", 0.0))
        self._l(self.free_blocks).set(stats.get("num_free_blocks", 0))
        self._l(self.total_blocks).set(stats.get("num_blocks", 0))
        for key, metric in (
            ("num_preemptions", self.preemptions),
            ("prefix_cache_queries", self.prefix_queries),
            ("prefix_cache_hits", self.prefix_hits),
            ("kvc_compressions", self.kvc_compressions),
            ("kvc_evicted_kvs", self.kvc_evicted),
            *self._spec_counters(stats),
            *self._lazy_counters("offload", stats, _OFFLOAD_COUNTERS),
            *self._lazy_counters("kv_transfer", stats, _TRANSFER_COUNTERS),
            *self._lazy_counters("dp", stats, _DP_COUNTERS),
        ):
            value = float(stats.get(key, 0))
            delta = value - self._last.get(key, 0.0)
            if delta > 0:
                self._l(metric).inc(delta)
            self._last[key] = value
        for pos, value in enumerate(stats.get("spec_decode_num_accepted_tokens_per_pos", ())):
            key = f"spec_pos_{pos}"
            delta = float(value) - self._last.get(key, 0.0)
            child = self._l(self.spec_accepted_pos, position=str(pos))  # 0 until it moves
            if delta > 0:
                child.inc(delta)
            self._last[key] = float(value)
        pairs = stats.get("moe_expert_pairs")
        if pairs is not None and self.expert_pairs is None:
            self.expert_pairs = self._counter(
                "pagedllm:moe_expert_pairs",
                "(Token, expert) pairs each expert computed, over the MoE layers.",
                ("expert",),
            )
        for expert, value in enumerate(pairs or ()):
            key = f"expert_{expert}"
            delta = float(value) - self._last.get(key, 0.0)
            child = self._l(self.expert_pairs, expert=str(expert))
            if delta > 0:
                child.inc(delta)
            self._last[key] = float(value)
        steps = stats.get("num_steps")
        if steps is not None:  # cumulative in the engine: one call may cover several steps
            if steps > self._last.get("num_steps", 0.0):
                self._l(self.steps).inc(steps - self._last.get("num_steps", 0.0))
            self._last["num_steps"] = steps
        elif outputs:
            self._l(self.steps).inc()
        now = time.monotonic()
        generated = 0
        for out in outputs:
            generated += self._record_output(out, now)
        if generated:
            self._l(self.generation_tokens).inc(generated)

    def _record_output(self, out: RequestOutput, now: float) -> int:
        """Count one output. With parallel sampling (n > 1) the generation tokens of every
        sequence count; TPOT is measured along the longest sequence. A beam search reports
        once, at its end, with its hypotheses as the outputs. Returns the tokens it added."""
        rid = out.request_id
        n_new = sum(len(c.token_ids) for c in out.outputs)
        per_seq = self._num_tokens.setdefault(rid, {})
        for c in out.outputs:
            per_seq[c.index] = per_seq.get(c.index, 0) + len(c.token_ids)
        if (n_new or out.finished) and rid not in self._counted_prompts:
            self._counted_prompts.add(rid)
            self._l(self.prompt_tokens).inc(len(out.prompt_token_ids))
            first = out.metrics.get("first_token_time")
            arrival = out.metrics.get("arrival_time")
            if first is not None and arrival is not None and n_new:
                self._l(self.ttft).observe(max(0.0, first - arrival))
            queued = out.metrics.get("queued_time")
            scheduled = out.metrics.get("first_scheduled_time")
            if queued is not None and arrival is not None:
                self._l(self.handoff).observe(max(0.0, queued - arrival))
            if scheduled is not None and queued is not None:
                self._l(self.queue_time).observe(max(0.0, scheduled - queued))
                if first is not None:
                    self._l(self.prefill_time).observe(max(0.0, first - scheduled))
        if not out.finished:
            return n_new
        self._num_tokens.pop(rid, None)
        self._counted_prompts.discard(rid)
        completion = out.outputs[0] if out.outputs else None
        reason = (completion.finish_reason if completion else None) or "abort"
        self._l(self.success, finished_reason=reason).inc()
        arrival = out.metrics.get("arrival_time")
        first = out.metrics.get("first_token_time")
        if arrival is not None:
            self._l(self.e2e).observe(max(0.0, now - arrival))
        longest = max(per_seq.values(), default=0)
        if first is not None and longest > 1:
            self._l(self.tpot).observe(max(0.0, now - first) / (longest - 1))
        self._l(self.req_prompt).observe(len(out.prompt_token_ids))
        self._l(self.req_gen).observe(sum(per_seq.values()))
        return n_new

    def render(self) -> bytes:
        """The Prometheus text exposition of this registry."""
        return generate_latest(self.registry)
