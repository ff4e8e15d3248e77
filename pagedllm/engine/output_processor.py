"""Turns EngineCoreOutputs into RequestOutputs: detokenized text, logprobs, stop strings,
and the n sequences of parallel sampling gathered under their request."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from pagedllm.core.sched.output import EngineCoreOutput
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

LogprobTriple = tuple[list[int], list[float], list[int]]


@dataclass
class SeqState:
    """One generated sequence of a request."""

    index: int
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0
    sent_logprobs: int = 0


@dataclass
class RequestState:
    """What the front end keeps per request while it runs."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    output_kind: str  # "final" | "delta" | "cumulative"
    arrival_time: float
    seqs: list[SeqState] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    first_token_time: float | None = None
    # the engine core's stamps (EngineCoreOutput.timing): queued, first scheduled
    queued_time: float | None = None
    scheduled_time: float | None = None

    @property
    def finished(self) -> bool:
        for s in self.seqs:  # a loop, not all(genexpr): this runs per request per step
            if s.finish_reason is None:
                return False
        return True


class OutputProcessor:
    """Per-request detokenization and assembly of RequestOutput objects."""

    def __init__(self, tokenizer: Any, kv_transfer: Any = None) -> None:
        self.tokenizer = tokenizer
        # a KV producer's KVTransferConfig: its finished requests name their transfer
        self.kv_transfer = (
            kv_transfer if kv_transfer is not None and kv_transfer.is_producer else None
        )
        self.states: dict[str, RequestState] = {}

    def _new_seq(self, index: int, prompt_token_ids: list[int], params: SamplingParams) -> SeqState:
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
        seq = SeqState(index, detok)
        if params.logprobs is not None:
            seq.logprobs, seq.cumulative_logprob = [], 0.0
        return seq

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        output_kind: str = "final",
    ) -> None:
        num_seqs = params.num_sequences
        state = RequestState(
            request_id, prompt, prompt_token_ids, params, output_kind, time.monotonic()
        )
        state.seqs = [self._new_seq(i, prompt_token_ids, params) for i in range(num_seqs)]
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
        for seq in state.seqs:
            if seq.finish_reason is None:
                seq.finish_reason = "abort"
        return self._make_output(state, state.seqs)

    def process_outputs(
        self, outputs: list[EngineCoreOutput]
    ) -> tuple[list[RequestOutput], list[str], list[str]]:
        """(RequestOutputs to hand out, engine-core ids of sequences that hit a stop string and
        must be finished in the core, ids of requests that failed here and must be aborted in
        the core).

        A request whose output cannot be made (its detokenizer or a logprob's decode raised)
        ends alone: its last output carries the error (``RequestOutput.error``), the others
        go on."""
        stopped: list[str] = []
        failed: list[str] = []
        results: list[RequestOutput] = []
        # requests that progressed, in first-touch order, and which of the sequences of a
        # request with n > 1 did: ONE output per request however many steps ``outputs`` spans
        touched: dict[str, RequestState] = {}
        multi: dict[str, list[SeqState]] = {}
        now = time.monotonic()
        for out in outputs:
            rid = out.parent_id or out.request_id
            state = self.states.get(rid)
            if state is None:
                continue
            if out.beam_sequences is not None:
                results.append(self._beam_output(state, out))
                del self.states[rid]
                continue
            if out.error is not None:  # the engine ended the whole request (e.g. bad grammar)
                for s in state.seqs:
                    s.finish_reason = s.finish_reason or "abort"
                result = self._make_output(state, state.seqs)
                result.error = out.error
                results.append(result)
                del self.states[rid]
                continue
            seq = state.seqs[out.seq_index]
            if seq.finish_reason is not None:
                # a sequence a stop string ended here, still stepped by an engine core in
                # another process until our "stop" reaches it: its late tokens are dropped
                continue
            if out.new_token_ids and state.first_token_time is None:
                state.first_token_time = now
            if out.timing is not None and state.queued_time is None:
                state.queued_time, state.scheduled_time = out.timing
            state.num_cached_tokens = out.num_cached_tokens
            try:
                if out.new_prompt_logprobs is not None and state.prompt_logprobs is not None:
                    start, rows = out.new_prompt_logprobs
                    if start == len(state.prompt_logprobs):  # not a recompute (preemption)
                        state.prompt_logprobs.extend(self._logprob_dicts(rows))
                if self._update_seq(seq, out):
                    stopped.append(out.request_id)
            except Exception as e:
                touched.pop(rid, None)
                results.append(self._fail(state, e))
                failed.append(rid)
                continue
            touched[rid] = state
            if len(state.seqs) > 1:
                seqs = multi.setdefault(rid, [])
                if seq not in seqs:
                    seqs.append(seq)
        for rid, state in touched.items():
            finished = state.finished
            if state.output_kind == "final" and not finished:
                continue
            try:
                results.append(self._make_output(state, multi.get(rid, state.seqs)))
            except Exception as e:
                results.append(self._fail(state, e))
                failed.append(rid)
                continue
            if finished:
                del self.states[rid]
        return results, stopped, failed

    def _fail(self, state: RequestState, error: Exception) -> RequestOutput:
        """End a request whose output could not be made: forget it and return its last output
        (no new text; every unfinished sequence 'abort'; ``error`` set)."""
        logger.exception("request %s: making its output failed", state.request_id)
        self.states.pop(state.request_id, None)
        completions = []
        for seq in state.seqs:
            seq.finish_reason = seq.finish_reason or "abort"
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    text="",
                    token_ids=[],
                    cumulative_logprob=seq.cumulative_logprob,
                    logprobs=None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=None,
            outputs=completions,
            finished=True,
            num_cached_tokens=state.num_cached_tokens,
            error=f"making this request's output failed: {error!r}",
        )

    def _update_seq(self, seq: SeqState, out: EngineCoreOutput) -> bool:
        """Apply one step's tokens to a sequence; True if a stop string ended it."""
        seq.token_ids.extend(out.new_token_ids)
        if seq.logprobs is not None and out.new_logprobs:
            dicts = self._logprob_dicts(out.new_logprobs)
            seq.logprobs.extend(dicts)
            for tok, d in zip(out.new_token_ids, dicts):
                seq.cumulative_logprob = (seq.cumulative_logprob or 0.0) + d[tok].logprob
        seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason
        if seq.detokenizer is not None and out.new_token_ids:
            stop_str = seq.detokenizer.update(
                out.new_token_ids, stop_terminated=out.finish_reason == "stop"
            )
            if stop_str is not None and out.finish_reason is None:
                seq.finish_reason, seq.stop_reason = "stop", stop_str
                return True
        return False

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

    def _completion(self, state: RequestState, seq: SeqState) -> CompletionOutput:
        delta = state.output_kind == "delta"
        done = seq.finish_reason is not None
        text = seq.detokenizer.get_next_output_text(done, delta) if seq.detokenizer else ""
        if delta:
            token_ids = seq.token_ids[seq.sent_tokens :]
            logprobs = seq.logprobs[seq.sent_logprobs :] if seq.logprobs is not None else None
            seq.sent_tokens = len(seq.token_ids)
            seq.sent_logprobs = len(seq.logprobs) if seq.logprobs is not None else 0
        else:
            token_ids = list(seq.token_ids)
            logprobs = list(seq.logprobs) if seq.logprobs is not None else None
        if state.params.hide_logprobs:
            logprobs = None  # computed only to rank best_of sequences
        return CompletionOutput(
            index=seq.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=seq.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )

    def _beam_output(self, state: RequestState, out: EngineCoreOutput) -> RequestOutput:
        """The hypotheses of a finished beam search as CompletionOutputs, best first."""
        assert out.beam_sequences is not None
        completions = []
        for i, (tokens, cum, _score, reason) in enumerate(out.beam_sequences):
            text = self.tokenizer.decode(tokens, skip_special_tokens=True) if self.tokenizer else ""
            completions.append(
                CompletionOutput(
                    index=i,
                    text=text,
                    token_ids=list(tokens),
                    cumulative_logprob=cum,
                    logprobs=None,
                    finish_reason=reason,
                )
            )
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=None,
            outputs=completions,
            finished=True,
            num_cached_tokens=out.num_cached_tokens,
        )

    def _make_output(self, state: RequestState, seqs: list[SeqState]) -> RequestOutput:
        finished = state.finished
        n = state.params.n
        if state.output_kind == "final" or (finished and state.output_kind != "delta"):
            seqs = state.seqs
        completions = [self._completion(state, s) for s in seqs]
        if finished and len(state.seqs) > n and state.output_kind != "delta":
            # best_of: the n sequences with the highest cumulative logprob, re-indexed
            completions.sort(key=lambda c: c.cumulative_logprob or 0.0, reverse=True)
            completions = completions[:n]
            for i, c in enumerate(completions):
                c.index = i
        metrics = {"arrival_time": state.arrival_time}
        if state.first_token_time is not None:
            metrics["first_token_time"] = state.first_token_time
        if state.queued_time is not None:  # vLLM's RequestMetrics names, one clock
            metrics["queued_time"] = state.queued_time
            if state.scheduled_time is not None:
                metrics["first_scheduled_time"] = state.scheduled_time
                metrics["time_in_queue"] = state.scheduled_time - state.queued_time
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=state.prompt_logprobs,
            outputs=completions,
            finished=finished,
            num_cached_tokens=state.num_cached_tokens,
            metrics=metrics,
            kv_transfer_params=self._transfer(state) if finished and self.kv_transfer else None,
        )

    def _transfer(self, state: RequestState) -> dict | None:
        """A producer's finished request that asked to hand its KV over: where it went."""
        from pagedllm.core.kv_transfer.scheduler import producer_params, transfer_params

        try:
            params = transfer_params(state.params)
        except ValueError:  # (the engine refused the request for it)
            return None
        if not params or not params.get("do_remote_decode"):
            return None
        if any(s.finish_reason == "abort" for s in state.seqs):
            return None
        return producer_params(self.kv_transfer, state.request_id)
