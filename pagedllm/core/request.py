"""The scheduler's view of one request: its tokens, progress and status."""

from __future__ import annotations

import time
from collections.abc import Sequence
from enum import IntEnum
from typing import TYPE_CHECKING

from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.lora.request import LoRARequest


class RequestStatus(IntEnum):
    """Lifecycle of a request. Every finished state comes after PREEMPTED, so
    ``status > RequestStatus.PREEMPTED`` is "finished" in one comparison."""

    WAITING = 0
    WAITING_FOR_GRAMMAR = 1  # structured output: its grammar is still compiling
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH_CAPPED = 5
    FINISHED_ABORTED = 6
    FINISHED_IGNORED = 7  # rejected: could never be served

    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    def finish_reason(self) -> str | None:
        # indexed by value: hashing an enum member runs Python code, 3 us a call
        return _FINISH_REASONS[self._value_]


# a plain int: looking a member up on the enum class costs more than the comparison
_LAST_UNFINISHED = int(RequestStatus.PREEMPTED)
_FINISH_REASONS: tuple[str | None, ...] = (
    None,
    None,
    None,
    None,
    "stop",
    "length",
    "abort",
    "length",
)


class ConstantList(Sequence[int]):
    """A read-only view of a list, so callers cannot change a request's tokens behind its back."""

    __slots__ = ("_x",)

    def __init__(self, x: list[int]) -> None:
        self._x = x

    def __getitem__(self, i):  # noqa: ANN001, ANN204
        return self._x[i]

    def __len__(self) -> int:
        return len(self._x)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ConstantList):
            other = other._x
        return self._x == other

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ConstantList({self._x!r})"


class Request:
    """One prompt and the tokens generated for it so far.

    ``num_computed_tokens`` counts the tokens whose K/V are in the cache; each step the scheduler
    gives the request enough tokens to catch up with ``num_tokens`` (prompt + output).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        max_model_len: int | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_computed_tokens = 0
        # Tokens sampled by steps already launched whose ids have not reached the host yet
        # (0 or 1, 2 under async scheduling): the scheduler counts them as known tokens.
        self.num_output_placeholders = 0
        # Drafts made on the device (ngram_gpu) under async scheduling: the drafts of steps
        # launched and not yet resolved, counted in num_computed_tokens as if all accepted
        # (the update takes the rejected ones back off)
        self.num_unverified = 0
        # The first step whose drafts were made on the device (None: none yet, or since the
        # runner last took the request in): from it on the runner leaves every new token of
        # the request to the scheduler (CachedRequestData.append_token_ids)
        self.device_drafts_since: int | None = None
        # The drafts the device lookup found after the request's last resolved step (None:
        # none resolved yet): its next steps plan that many placeholders (a step behind under
        # async scheduling: the lookups after consecutive steps mostly agree)
        self.device_drafts_found: int | None = None
        self.num_cached_tokens = -1  # prefix-cache hit of the first scheduling; -1 = not yet
        # the core's clock (time.monotonic: one clock for every process of the host) when
        # the scheduler queued the request and first scheduled it; the first output with
        # tokens carries both to the front end (EngineCoreOutput.timing), once
        self.queued_time: float | None = None
        self.scheduled_time: float | None = None
        self._timing_sent = False
        self.num_preemptions = 0
        self.swapped = False  # preempted by swap: its KV waits in host memory
        self.parent_id: str | None = None  # parallel sampling: the request this sequence is of
        self.seq_index = 0  # which of the request's n sequences
        self.beam_group: str | None = None  # beam search: the search this beam belongs to
        self.pending_runner_tokens: list[int] = []  # tokens chosen here, not yet sent
        self.grammar_future = None  # structured output: Future of the compiled grammar
        # structured output: the key of its matcher in the engine's Grammars (a serial number:
        # unique even when a finished request's id is used again; cheap to send each step)
        self.grammar_key: int | None = None
        # structured output after reasoning: the token that ends the thinking (``</think>``)
        # while the request has not sampled it; its grammar applies from the next token on
        so = sampling_params.structured_outputs
        self.reasoning_end_token_id: int | None = so.reasoning_end_token_id if so else None
        # ... and, before its first token, the token that would open the thinking (None: the
        # output starts inside it)
        self.reasoning_start_token_id: int | None = so.reasoning_start_token_id if so else None
        self.error: str | None = None  # why the engine ended the request (e.g. bad grammar)
        self.cache_salt: str | None = None  # isolates this tenant's prefix-cache entries
        self.lora_request: LoRARequest | None = None  # its LoRA adapter (None: the base model)
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        max_tokens = sampling_params.max_tokens
        if max_model_len is not None:
            room = max_model_len - self.num_prompt_tokens
            max_tokens = room if max_tokens is None else min(max_tokens, room)
        self.max_tokens: int = max_tokens if max_tokens is not None else 2**31
        self.output_token_ids = ConstantList(self._output_token_ids)
        self.all_token_ids = ConstantList(self._all_token_ids)

    def mark_scheduled(self, num_hit: int) -> None:
        """Taken from the waiting queue with ``num_hit`` tokens cached: the first time, its
        prefix-cache hit and the time are kept (a preempted request's later scheduling
        changes neither)."""
        if self.num_cached_tokens < 0:
            self.num_cached_tokens = num_hit
            self.scheduled_time = time.monotonic()

    def first_timing(self) -> tuple[float | None, float | None] | None:
        """(queued, first scheduled) the first time it is asked (the output with the first
        tokens carries them), None after."""
        if self._timing_sent:
            return None
        self._timing_sent = True
        return self.queued_time, self.scheduled_time

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status > _LAST_UNFINISHED

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self._output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)

    @property
    def needs_host_tokens(self) -> bool:
        """Whether this request's next forward pass needs its last sampled token on the host:
        penalties over its output, bad words of several tokens (matched against its last
        tokens), a beam or sibling sequences to fork. Such requests keep the engine in
        synchronous steps. (A grammar needs the token only before sampling: see
        EngineCore.step.)"""
        p = self.sampling_params
        return (
            p.uses_penalties
            or p.bad_words_need_history
            or p.external_tokens
            or self.parent_id is not None
            or self.beam_group is not None
        )

    def get_finished_reason(self) -> str | None:
        return self.status.finish_reason()

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
