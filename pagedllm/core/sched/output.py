"""What the scheduler tells the model runner each step, and what comes back to the engine.

Everything here is plain data (pickles): it crosses to worker processes (worker/executor.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedllm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen (or has dropped, after a preemption): sent in full."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty when resuming a preempted request by recompute
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]  # per KV-cache group, in table order
    num_computed_tokens: int
    lora_int_id: int = 0  # its LoRA adapter (0: the base model)


@dataclass
class CachedRequestData:
    """A request the runner already holds: only what changed since the last step."""

    req_id: str
    new_block_ids: tuple[list[int], ...]  # per KV-cache group; () when none is new
    num_computed_tokens: int
    # (group, table index, block id): entries copy-on-write replaced (a forked block made
    # private)
    replaced_block_ids: list[tuple[int, int, int]] = field(default_factory=list)
    # Tokens the scheduler chose (beam search) for the runner to append to its copy.
    append_token_ids: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    """One step's plan. The batch order is the insertion order of ``num_scheduled_tokens``."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # Swap preemption: copy these (device block, host block) pairs out, and (host, device)
    # pairs in, before the forward pass.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    # expert parallelism over data-parallel engine cores: every core's tokens this step
    # (engine/dp_sync.py), which the MoE layers' exchange pads to; () otherwise
    dp_step_tokens: tuple[int, ...] = ()
    # and with dual-batch overlap every core's tokens in micro-batches a and b
    # (worker/ubatch.py); None: one batch
    dp_ubatch_tokens: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    # Copy-on-write: (src, dst) device blocks to copy before the forward pass.
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # Structured outputs: the grammar keys (Request.grammar_key) of the scheduled requests
    # with a grammar that sample this step, and their indices in the batch order; their
    # token bitmask is filled (engine/core.py) while the forward pass runs.
    # (a request verifying drafts is a structured_output.matchers.SpecFill: 1 + k mask rows)
    structured_requests: list[Any] = field(default_factory=list)
    structured_batch_idx: list[int] = field(default_factory=list)
    # Speculative decoding: the draft tokens proposed for a request (only requests that have
    # some), counted in its ``num_scheduled_tokens`` as vLLM does: a decode with k drafts is
    # scheduled 1 + k tokens (its last known token, then the drafts, which the runner writes
    # after the known tokens as inputs only). Such a request samples at each of its k + 1
    # positions: ``ModelRunnerOutput.sampled_token_ids[i]`` = [s_0, ..., s_k], s_j being the
    # model's token after draft j - 1 (s_0: after the known tokens, what a plain decode
    # samples). The runner commits s_0 alone to its copy of the request (so a rejected draft
    # never enters it). What the scheduler must do with the k + 1 samples (acceptance):
    #   - accept a = the longest prefix with s_j == draft_j (j < a); the new tokens are
    #     s_0 .. s_a (a + 1 tokens: the accepted drafts, then the model's own token s_a);
    #     stop checks and grammars see them in order (rollback_structured for the rest);
    #   - before this step the request had T known tokens (num_computed T - 1 for a decode):
    #     after it, K/V hold positions up to T + a - 1, so ``num_computed_tokens`` = T + a
    #     (not T + k, which schedule() counted) and the rejected drafts' blocks may be freed;
    #   - tell the runner in the next step's CachedRequestData: ``num_computed_tokens``
    #     T + a and ``append_token_ids`` s_1 .. s_a (it holds s_0 already).
    # A scheduler that never proposes leaves this empty: steps run exactly as without it.
    scheduled_spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    # A draft model (speculative_config method "draft_model"): requests whose step ends with
    # a sample and that got lookahead slots -> the most drafts the runner's draft model
    # proposes after the step's newest token (it writes their KVs in those slots) and returns
    # in ModelRunnerOutput.draft_token_ids for the next step.
    draft_requests: dict[str, int] = field(default_factory=dict)
    # Speculative decoding paused by the load (``disable_by_batch_size``): nothing is drafted
    # or verified, and a draft model skips its run over the step (it catches up on the
    # skipped positions once speculation resumes: worker/drafter.py).
    spec_paused: bool = False
    # Drafts made on the device (speculative_config method "ngram_gpu"): the lists in
    # scheduled_spec_tokens are placeholders (their length is what counts; the runner reads
    # the tokens from its device drafts, worker/device_drafts.py). Under async scheduling a
    # request's step is planned before its last step's samples are known: the scheduler then
    # counts that step's drafts as accepted. ``spec_unverified``: such a request -> the drafts
    # of its unresolved last step counted in its num_computed_tokens; the runner takes the
    # rejected ones back off its positions on the device.
    device_drafts: bool = False
    spec_unverified: dict[str, int] = field(default_factory=dict)
    # KV connectors (core/sched/connector.py): each role's plan for the step by connector
    # name (KV-Compress: the evictions after the forward pass), for its worker role
    kv_connector_metadata: dict[str, Any] = field(default_factory=dict)
    # Which schedule() made this plan: the scheduler keeps the step's Request objects under
    # it until update_from_output (the plan itself is plain data, sent to worker processes).
    step_id: int = 0

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0

    def cached_rows(self) -> list[tuple]:
        """Each cached request as (req_id, new_block_ids, num_computed_tokens,
        replaced_block_ids, append_token_ids): the form the runner reads and the one that
        crosses to worker processes."""
        rows = self.__dict__.get("_cached_rows")
        if rows is None:
            rows = [
                (c.req_id, c.new_block_ids, c.num_computed_tokens, c.replaced_block_ids,
                 c.append_token_ids)
                for c in self.scheduled_cached_reqs
            ]  # fmt: skip
        return rows

    def __reduce__(self) -> tuple:
        """Pickled with the cached requests as plain tuples (``cached_rows``), rebuilt as
        ``CachedRequestData`` only if something asks for them: plain tuples pickle and load
        several times faster than dataclasses, and a decode step's plan takes this path to the
        worker processes under tensor parallelism at every step."""
        state = dict(vars(self))
        state["_cached_rows"] = self.cached_rows()
        state.pop("scheduled_cached_reqs", None)  # (absent from a loaded plan never expanded)
        return (_load_scheduler_output, (state,))

    def __getattr__(self, name: str) -> Any:
        # only for names not set: ``scheduled_cached_reqs`` of a plan that came pickled
        rows = self.__dict__.get("_cached_rows")
        if name != "scheduled_cached_reqs" or rows is None:
            raise AttributeError(name)
        reqs = [CachedRequestData(*t) for t in rows]
        self.__dict__["scheduled_cached_reqs"] = reqs
        return reqs


def _load_scheduler_output(state: dict) -> SchedulerOutput:
    """The inverse of ``SchedulerOutput.__reduce__``."""
    out = SchedulerOutput.__new__(SchedulerOutput)
    out.__dict__.update(state)
    return out


@dataclass
class ModelRunnerOutput:
    """Tokens sampled this step, per request of the batch that reached the end of its tokens.

    ``sampled_token_ids[i]`` is empty for a request whose prefill chunk did not reach its last
    token; for a request with k draft tokens it holds k + 1 samples in position order (see
    ``SchedulerOutput.scheduled_spec_tokens``), and ``logprobs[i]`` a triple for each.
    """

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    # per request: list (one per sampled token) of (token ids, logprobs, ranks) top-N + sampled
    logprobs: list[list[tuple[list[int], list[float], list[int]]] | None] | None = None
    # per request: (first prompt position predicted, [(token ids, logprobs, ranks)] per position)
    prompt_logprobs: dict[str, tuple[int, list[tuple[list[int], list[float], list[int]]]]] = field(
        default_factory=dict
    )
    # Parallel sampling: first tokens of sequences 1..n-1 of a request whose prompt completed
    # this step (sampled from the same logits), with their logprob triples when asked.
    forked_token_ids: dict[str, list[int]] = field(default_factory=dict)
    forked_logprobs: dict[str, list] = field(default_factory=dict)
    # The sampled token of each structured request, in SchedulerOutput.structured_requests'
    # order (for Grammars without a pass over every request); None when there are none.
    structured_tokens: list[int] | None = None
    # KV connectors: each worker role's report by connector name (KV-Compress: request ->
    # the computed KVs left per (layer, KV head) [LH] of each evicted request)
    kv_connector_output: dict[str, Any] = field(default_factory=dict)
    # A draft model: request -> (the known tokens the drafts follow, the drafts), for the
    # requests of SchedulerOutput.draft_requests (see pagedllm/spec_decode/draft_model.py).
    draft_token_ids: dict[str, tuple[int, list[int]]] = field(default_factory=dict)
    # Drafts made on the device (SchedulerOutput.device_drafts): request -> the drafts its row
    # verified this step (a lookup that found nothing verifies none: []). The scheduler counts
    # the accepted ones from these; its scheduled_spec_tokens hold placeholders.
    device_draft_tokens: dict[str, list[int]] = field(default_factory=dict)
    # ... and request -> the drafts the lookup after this step found (what its next step
    # would verify; the scheduler plans as many placeholders next time, none if it found none)
    device_draft_found: dict[str, int] = field(default_factory=dict)


@dataclass
class EngineCoreOutput:
    """What changed for one request in one step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[tuple[list[int], list[float], list[int]]] | None = None
    new_prompt_logprobs: tuple[int, list[tuple[list[int], list[float], list[int]]]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    parent_id: str | None = None  # set for the sequences of a request with n > 1
    seq_index: int = 0
    # beam search, when it ends: (tokens, cumulative logprob, score, finish reason), best first
    beam_sequences: list[tuple[list[int], float, float, str]] | None = None
    # with a request's first tokens: (queued, first scheduled) on the core's monotonic clock
    timing: tuple[float | None, float | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def pack_outputs(outputs: list[EngineCoreOutput]) -> list[tuple]:
    """Plain tuples for the wire (the engine core process): pickling plain tuples is several
    times cheaper than pickling the dataclasses, and the outputs cross at every step."""
    return [
        (
            o.request_id,
            o.new_token_ids,
            o.new_logprobs,
            o.new_prompt_logprobs,
            o.finish_reason,
            o.stop_reason,
            o.num_cached_tokens,
            o.error,
            o.parent_id,
            o.seq_index,
            o.beam_sequences,
            o.timing,
        )
        for o in outputs
    ]


def unpack_outputs(packed: list[tuple]) -> list[EngineCoreOutput]:
    """The inverse of ``pack_outputs`` (fields in declaration order)."""
    return [EngineCoreOutput(*t) for t in packed]
