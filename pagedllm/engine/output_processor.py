"""Turns EngineCoreOutputs into RequestOutputs: detokenized text, logprobs, stop strings."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pagedllm.core.sched.output import EngineCoreOutput
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from pagedllm.sampling_params import SamplingParams

LogprobTriple = tuple[list[int], list[float], list[int]]


@dataclass
class RequestState:
    """What the front end keeps per request while it runs."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    output_kind: str  # "final" | "delta" | "cumulative"
    arrival_time: float
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    first_token_time: float | None = None
    sent_tokens: int = 0
    sent_logprobs: int = 0


class OutputProcessor:
    """Per-request detokenization and assembly of RequestOutput objects."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        output_kind: str = "final",
    ) -> None:
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(
                self.tokenizer,
                prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
                stop=list(params.stop or []),
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
        state = RequestState(
            request_id, prompt, prompt_token_ids, params, detok, output_kind, time.monotonic()
        )
        if params.logprobs is not None:
            state.logprobs = []
            state.cumulative_logprob = 0.0
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]
        self.states[request_id] = state

    def has(self, request_id: str) -> bool:
        return request_id in self.states

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish a request from outside (abort): its final output with reason 'abort'."""
        state = self.states.pop(request_id, None)
        if state is None:
            return None
        return self._make_output(state, "abort", None, finished=True)

    def process_outputs(
        self, outputs: list[EngineCoreOutput]
    ) -> tuple[list[RequestOutput], list[str]]:
        """(RequestOutputs to hand out, ids that hit a stop string and must be finished in the
        engine core)."""
        results: list[RequestOutput] = []
        stopped: list[str] = []
        now = time.monotonic()
        for out in outputs:
            state = self.states.get(out.request_id)
            if state is None:
                continue
            if out.new_token_ids and state.first_token_time is None:
                state.first_token_time = now
            state.num_cached_tokens = out.num_cached_tokens
            if out.new_prompt_logprobs is not None and state.prompt_logprobs is not None:
                start, rows = out.new_prompt_logprobs
                if start == len(state.prompt_logprobs):  # ignore a recompute after preemption
                    state.prompt_logprobs.extend(self._logprob_dicts(rows))
            finish_reason, stop_reason = out.finish_reason, out.stop_reason
            state.token_ids.extend(out.new_token_ids)
            if state.logprobs is not None and out.new_logprobs:
                dicts = self._logprob_dicts(out.new_logprobs)
                state.logprobs.extend(dicts)
                for tok, d in zip(out.new_token_ids, dicts):
                    state.cumulative_logprob = (state.cumulative_logprob or 0.0) + d[tok].logprob
            if state.detokenizer is not None and out.new_token_ids:
                stop_str = state.detokenizer.update(
                    out.new_token_ids, stop_terminated=finish_reason == "stop"
                )
                if stop_str is not None and finish_reason is None:
                    finish_reason, stop_reason = "stop", stop_str
                    stopped.append(out.request_id)
            finished = finish_reason is not None
            if state.output_kind == "final" and not finished:
                continue
            results.append(self._make_output(state, finish_reason, stop_reason, finished))
            if finished:
                del self.states[out.request_id]
        return results, stopped

    def _logprob_dicts(self, rows: list[LogprobTriple]) -> list[dict[int, Logprob]]:
        result = []
        for ids, lps, ranks in rows:
            d: dict[int, Logprob] = {}
            for tid, lp, rank in zip(ids, lps, ranks):
                if tid not in d:
                    text = self.tokenizer.decode([tid]) if self.tokenizer is not None else None
                    d[tid] = Logprob(lp, rank, text)
            result.append(d)
        return result

    def _make_output(
        self,
        state: RequestState,
        finish_reason: str | None,
        stop_reason: int | str | None,
        finished: bool,
    ) -> RequestOutput:
        delta = state.output_kind == "delta"
        text = ""
        if state.detokenizer is not None:
            text = state.detokenizer.get_next_output_text(finished, delta)
        if delta:
            token_ids = state.token_ids[state.sent_tokens :]
            logprobs = state.logprobs[state.sent_logprobs :] if state.logprobs is not None else None
            state.sent_tokens = len(state.token_ids)
            state.sent_logprobs = len(state.logprobs) if state.logprobs is not None else 0
        else:
            token_ids = list(state.token_ids)
            logprobs = list(state.logprobs) if state.logprobs is not None else None
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=state.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
        )
        metrics = {"arrival_time": state.arrival_time}
        if state.first_token_time is not None:
            metrics["first_token_time"] = state.first_token_time
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=state.prompt_logprobs,
            outputs=[completion],
            finished=finished,
            num_cached_tokens=state.num_cached_tokens,
            metrics=metrics,
        )
