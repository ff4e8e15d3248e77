"""What the scheduler tells the model runner each step, and what comes back to the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.core.request import Request


@dataclass
class NewRequestData:
    """A request the runner has not seen (or has dropped, after a preemption): sent in full."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty when resuming a preempted request by recompute
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    """A request the runner already holds: only what changed since the last step."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    # (table index, block id): entries copy-on-write replaced (a forked block made private)
    replaced_block_ids: list[tuple[int, int]] = field(default_factory=list)
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
    # Copy-on-write: (src, dst) device blocks to copy before the forward pass.
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # Structured outputs: the grammar keys (Request.grammar_key) of the scheduled requests
    # with a grammar that sample this step, and their indices in the batch order; their
    # token bitmask is filled (engine/core.py) while the forward pass runs.
    structured_requests: list[int] = field(default_factory=list)
    structured_batch_idx: list[int] = field(default_factory=list)
    # The scheduler's own Request objects, in batch order (for its update: under async
    # scheduling a request that finished may have a token in flight while a new request
    # already uses its id). Not for the runner.
    requests: list[Request] = field(default_factory=list, repr=False)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class ModelRunnerOutput:
    """Tokens sampled this step, per request of the batch that reached the end of its tokens.

    ``sampled_token_ids[i]`` is empty for a request whose prefill chunk did not reach its last
    token; with speculative decoding it may hold several tokens.
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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
