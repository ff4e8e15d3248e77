"""The scheduler's side of beam search: turning each step's beam choices into block-table
operations (extend, fork, free) on the engine's requests. The search rule itself lives in
``pagedllm/beam_search.py``."""

from __future__ import annotations

import itertools

from pagedllm.beam_search import BeamSearchParams, BeamSearchState
from pagedllm.core.kv_cache.interface import KVCacheManagerBase
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched.groups import SequenceGroups
from pagedllm.core.sched.output import EngineCoreOutput


class BeamManager:
    """Owns the BeamSearchState of every beam-search request."""

    def __init__(self, kv: KVCacheManagerBase, groups: SequenceGroups) -> None:
        self.kv = kv
        self.groups = groups
        self.states: dict[str, BeamSearchState] = {}
        self._ids = itertools.count(1)

    def register(self, request: Request, params: BeamSearchParams, eos_ids: set[int]) -> None:
        """Make ``request`` (the prompt) the first beam of a new search."""
        gid = request.request_id
        # the request's max_tokens is already capped to the room left in max_model_len / cache
        self.states[gid] = BeamSearchState(
            params, request.num_prompt_tokens, eos_ids, gid, max_new_tokens=request.max_tokens
        )
        request.beam_group = gid
        request.parent_id = gid
        self.groups.members[gid] = [request]

    def on_step(
        self, request: Request, logprobs: list | None, requests: dict[str, Request]
    ) -> tuple[list[Request], list[Request], EngineCoreOutput | None]:
        """Take one beam's top logprobs. When every live beam of its search has reported,
        advance the search: returns (new forked requests, requests to free, the final output
        of the search when it is over)."""
        gid = request.beam_group
        assert gid is not None and logprobs
        state = self.states[gid]
        ids, lps, _ = logprobs[0]
        seen: dict[int, float] = {}
        for t, lp in zip(ids, lps):
            seen.setdefault(t, lp)
        if not state.report(request.request_id, list(seen.items())):
            return [], [], None
        live = {b.request_id: requests[b.request_id] for b in state.beams}
        choices = state.step()
        uses: dict[str, int] = {}
        new_ids: list[str] = []
        forks: list[Request] = []
        extend: list[tuple[Request, int]] = []
        for c in choices:
            parent = live[c.parent]
            uses[c.parent] = uses.get(c.parent, 0) + 1
            if uses[c.parent] == 1:
                extend.append((parent, c.token))
                new_ids.append(parent.request_id)
            else:  # fork before the parent is extended: the child copies its current tokens
                child = self._fork(parent, c.token)
                forks.append(child)
                new_ids.append(child.request_id)
        for parent, token in extend:
            parent.append_output_token_ids(token)
            parent.pending_runner_tokens.append(token)
        for b, rid in zip(state.beams, new_ids):
            b.request_id = rid
        dropped = [r for rid, r in live.items() if rid not in uses]
        final = None
        if state.done:
            dropped = list(live.values())
            final = self._final_output(gid, state)
            del self.states[gid]
        for r in dropped:
            r.status = RequestStatus.FINISHED_STOPPED
        return forks, dropped, final

    def _fork(self, parent: Request, token: int) -> Request:
        gid = parent.beam_group
        child = Request(
            f"{gid}#beam{next(self._ids)}",
            parent.prompt_token_ids,
            parent.sampling_params,
            eos_token_id=parent.eos_token_id,
            arrival_time=parent.arrival_time,
            priority=parent.priority,
        )
        child.max_tokens = parent.max_tokens
        child.beam_group = child.parent_id = gid
        child.lora_request = parent.lora_request
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = RequestStatus.RUNNING
        self.kv.fork(parent, child)
        child.append_output_token_ids(list(parent.output_token_ids) + [token])
        self.groups.members[gid].append(child)
        return child

    @staticmethod
    def _final_output(gid: str, state: BeamSearchState) -> EngineCoreOutput:
        seqs = state.results()
        reason = "stop" if seqs and seqs[0].finish_reason == "stop" else "length"
        return EngineCoreOutput(
            request_id=gid,
            new_token_ids=[],
            finish_reason=reason,
            beam_sequences=[(s.tokens, s.cum_logprob, s.score, s.finish_reason) for s in seqs],
        )

    def abort(self, gid: str) -> None:
        self.states.pop(gid, None)
