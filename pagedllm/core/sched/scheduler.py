"""The iteration-level scheduler.

THE RULE. There is no prefill phase and no decode phase. Every request has ``num_computed_tokens``
(tokens whose K/V are in the cache) and ``num_tokens`` (prompt + output so far). Each step hands
out one token budget, ``max_num_batched_tokens``, so that requests catch up: first the running
requests, in policy order (a decode needs 1 token, an unfinished prompt gets the rest of the
budget, chunked), then the waiting requests, in policy order, while the budget, ``max_num_seqs``
and the KV cache allow. When a running request cannot get a block, the running request ranked last
(for FCFS: the most recently arrived) is preempted: by recompute (its blocks are freed,
``num_computed_tokens`` goes back to 0; with prefix caching its full blocks stay cached, so
resuming is mostly a cache hit) or by swap (its blocks are copied to host memory and back on
resume); it waits again at the place its rank gives it (for FCFS: the front). No waiting request is
admitted in a step whose running phase preempted. Under the priority policy a waiting request may,
before the running phase, preempt running requests of a strictly larger priority value when memory
or max_num_seqs is short (see ``_preempt_for_priority``).

Swap or recompute (``preemption_mode``): 'recompute'; 'swap' (falls back to recompute when the
swap space is full); 'auto' swaps when moving a token's KV out and back costs less than
recomputing it: 2 x kv_bytes_per_token / host_bandwidth < 2 x num_params / device_flops, which
holds on CPUs and for large models, and usually fails on GPUs for small ones.

Example (budget 1024, chunked prefill): three waiting prompts of 400, 400 and 600 tokens are
scheduled 400, 400, 224 in the first step; the next step gives the third prompt its last 376
tokens and 1 token to each of the first two, which are decoding.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from pagedllm.config import CacheConfig, KVCompressConfig, SchedulerConfig, kv_connector_names
from pagedllm.core.kv_cache.factory import make_kv_cache_manager
from pagedllm.core.kv_cache.spec import KVCacheGroups
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched.beams import BeamManager
from pagedllm.core.sched.checks import check_admissible, check_stop
from pagedllm.core.sched.connector import ConnectorContext, make_scheduler_roles
from pagedllm.core.sched.groups import SequenceGroups, num_sequences
from pagedllm.core.sched.lora import LoRAAdmission, lora_id_of
from pagedllm.core.sched.output import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from pagedllm.core.sched.policy import Now, RankedQueue, make_policy
from pagedllm.core.sched.roles import role_configs
from pagedllm.core.sched.spec import SpecDecoding
from pagedllm.core.sched.structured import GrammarBook

if TYPE_CHECKING:
    from pagedllm.spec_decode import SpeculativeConfig
    from pagedllm.structured_output.grammars import GrammarStep


class Scheduler:
    """Decides, each step, which requests run and how many tokens each computes."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        num_host_blocks: int = 0,
        swap_is_cheaper: bool = False,
        clock: Callable[[], float] = time.monotonic,
        kv_groups: KVCacheGroups | None = None,
        kvc_config: KVCompressConfig | None = None,
        spec_config: SpeculativeConfig | None = None,
        kv_connectors: tuple[str, ...] = (),
        context_parallel: int = 1,  # DCP ranks: a block spans a page of each
        max_loras: int = 0,  # LoRA: distinct adapters among the running requests (0: no LoRA)
    ) -> None:
        self.config = scheduler_config
        self.max_model_len = scheduler_config.max_model_len
        # speculative decoding: drafts before a step, acceptance after it (core/sched/spec.py)
        self.spec = SpecDecoding(spec_config, self.max_model_len) if spec_config else None
        # the KV manager for the model's KV-cache groups (a single table when none are given)
        self.kv_cache_manager = make_kv_cache_manager(
            kv_groups, num_blocks, cache_config.block_size * context_parallel,
            cache_config.enable_prefix_caching, num_host_blocks,
            scheduler_config.max_num_batched_tokens,
        )  # fmt: skip
        mode = cache_config.preemption_mode
        self.use_swap = mode == "swap" or (mode == "auto" and swap_is_cheaper)
        self.clock = clock
        # "now" for the waiting queue's ranks, in a holder its key closes over (a closure over
        # self: a cycle only the cyclic collector frees, frozen after a CUDA start-up)
        self._now = Now(clock())
        self.policy = make_policy(
            scheduler_config.policy,
            scheduler_config.sjf_aging_rate,
            self.kv_cache_manager.num_cached_prefix_tokens,
        )
        self.requests: dict[str, Request] = {}
        policy, now = self.policy, self._now
        self.waiting = RankedQueue(lambda r: policy.waiting_rank(r, now.value))
        self.running = RankedQueue(self.policy.running_rank)
        self._swap_out: list[tuple[int, int]] = []
        self.num_swaps = 0
        self.groups = SequenceGroups()
        # structured outputs: grammar keys, matchers and their operations (core/sched/structured)
        self.grammar_book = GrammarBook()
        self.failed: list[Request] = []  # ended by the engine (bad grammar), to report
        self.beams = BeamManager(self.kv_cache_manager, self.groups)
        # Steps in flight whose drafts were made on the host (``needs_sync``)
        self._host_draft_steps: set[int] = set()
        # Requests finished since the last schedule(): the runner drops their state.
        self.finished_req_ids: set[str] = set()
        self._runner_has: set[str] = set()  # requests the runner holds state for
        self.num_preemptions = 0
        # Live requests needing host tokens (Request.needs_host_tokens): steps run synchronously
        self._sync_ids: set[str] = set()
        # The Request objects of each scheduled step, in batch order, until its update (two in
        # flight under async scheduling; a finished request's id may be reused meanwhile).
        self._in_flight: dict[int, list[Request]] = {}
        self._step_ids = itertools.count()
        # what changes a KV cache's life: roles called at the hooks below (sched/connector.py)
        context = ConnectorContext(
            self.kv_cache_manager, self.requests, self.running, self.waiting, self._runner_has,
            scheduler_config, self.fail_requests,
        )  # fmt: skip
        names = kv_connector_names(kvc_config, kv_connectors)
        configs = role_configs(kvc_config, cache_config, kv_groups)
        self.connectors = make_scheduler_roles(names, context, configs)
        # the roles that may shorten a request's tokens (the rest are skipped per request)
        self._cutters = [c for c in self.connectors if c.cuts_tokens]
        self.loras = LoRAAdmission(max_loras)  # LoRA: max_loras adapters (core/sched/lora.py)

    # ----------------------------------------------------------------- requests in and out
    def add_request(self, request: Request) -> None:
        """Queue a validated request. Raises ValueError if it could never be served."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use.")
        capacity = self.kv_cache_manager.token_capacity()
        check_admissible(request, self.config.max_num_seqs, self.max_model_len, capacity)
        request.status = RequestStatus.WAITING
        request.queued_time = time.monotonic()
        if request.sampling_params.structured_outputs is not None:
            self.grammar_book.submit(request)
        self.groups.register(request)
        self._track(request)
        self.waiting.add(request)

    def _track(self, request: Request) -> None:
        self.requests[request.request_id] = request
        for c in self.connectors:
            c.add_request(request)
        if request.needs_host_tokens:
            self._sync_ids.add(request.request_id)

    @property
    def needs_sync(self) -> bool:
        """Whether some live request needs synchronous steps, or speculative decoding with
        drafts made on the host is on and not paused by the load (a draft follows the last
        sampled token, on the host; ngram_gpu drafts on the device) or a step with such drafts
        is in flight (KV-Compress drops the rejected ones' KVs first). KV-Compress evictions
        do not: their lengths come back a step later."""
        if self._sync_ids or self._host_draft_steps:
            return True
        spec, running = self.spec, len(self.running)
        if spec is None or spec.device:
            return False
        return not spec.paused(running, self._admittable())

    def wants_results_first(self) -> bool:
        """Under async scheduling: whether the next step waits for the last step's results (a
        KV connector's rule, e.g. KV-Compress evictions in flight free blocks it wants)."""
        return any(c.wants_results_first() for c in self.connectors)

    def _admittable(self) -> int:
        """Waiting requests a free seat could take now (the speculation pacer pauses while a
        burst of them is admitted; a queue behind full seats does not count: speculating frees
        the seats sooner). Example: max_num_seqs 16, 12 running, 9 waiting -> 4."""
        return min(len(self.waiting), max(self.config.max_num_seqs - len(self.running), 0))

    def finish_requests(self, request_ids: list[str] | str, status: RequestStatus) -> None:
        """End requests from outside the loop (abort, or a stop string found by the
        detokenizer). Unknown or already finished ids are ignored."""
        request_ids = [request_ids] if isinstance(request_ids, str) else request_ids
        if status == RequestStatus.FINISHED_ABORTED:
            for rid in request_ids:
                self.beams.abort(rid)
            request_ids = self.groups.expand_ids(request_ids)  # all n sequences / beams
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                continue
            if request in self.running:
                self.running.remove(request)
            elif request in self.waiting:
                self.waiting.remove(request)
            request.status = status
            self._free_request(request)

    def fail_requests(self, errors: Mapping[str, str], invalid_keys: Sequence = ()) -> None:
        """End requests with an error (id -> why; a failed KV load, whose blocks' prefix-cache
        keys every role forgets first): the update reports them."""
        for c in self.connectors:
            c.on_cache_invalid(invalid_keys)
        for rid, why in errors.items():
            request = self.requests.get(rid)
            if request is not None and not request.is_finished:
                request.error = why
                self.finish_requests(request.parent_id or rid, RequestStatus.FINISHED_ABORTED)
                self.failed.append(request)

    def _free_request(self, request: Request) -> None:
        if self.spec is not None:
            self.spec.finish(request)
        self.grammar_book.release(request)
        self.kv_cache_manager.free(request)
        self.requests.pop(request.request_id, None)
        for c in self.connectors:
            c.on_free(request)
        self._sync_ids.discard(request.request_id)
        self.groups.finished(request)
        if request.request_id in self._runner_has:
            self._runner_has.discard(request.request_id)
            self.finished_req_ids.add(request.request_id)

    def fail_in_flight(self, everything: bool = False) -> list[str]:
        """After a step failed (in the executor, or here mid-step): end every request whose KV
        or tokens that step may have left wrong - the running ones, those of the steps in
        flight, the swapped ones (their copy out may have been in it) - and forget the steps
        in flight. Waiting requests are untouched unless ``everything``. The caller resets the
        runner. The prefix cache is emptied (a block cached in the failed step may never have
        been written). Returns the callers' ids of the ended requests (n > 1 or a beam search
        counts once)."""
        affected: dict[str, None] = {}
        for batch in self._in_flight.values():
            for r in batch:
                if not r.is_finished:
                    affected[r.parent_id or r.request_id] = None
        for r in list(self.running) + list(self.waiting):
            if everything or r in self.running or r.swapped or r.num_output_placeholders > 0:
                affected[r.parent_id or r.request_id] = None
        ids = list(affected)
        self.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        self._in_flight.clear()
        self._host_draft_steps.clear()
        self._swap_out = []
        self.kv_cache_manager.take_pending_copies()
        for c in self.connectors:
            c.reset()
        self._runner_has.clear()
        self.finished_req_ids = set()
        if not self.kv_cache_manager.reset_prefix_cache():
            raise RuntimeError("KV blocks are still in use after every running request ended.")
        return ids

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting or running."""
        return len(self.waiting) + len(self.running) > 0

    def get_num_unfinished_requests(self) -> int:
        """Number of waiting plus running requests."""
        return len(self.waiting) + len(self.running)

    # ----------------------------------------------------------------------- scheduling
    def schedule(self) -> SchedulerOutput:
        """Plan one step under the token budget (see THE RULE at the top of this file)."""
        self._now.value = self.clock()
        t_start = time.perf_counter()  # the speculation pacer's step starts here after idle
        if self.policy.dynamic:
            self.waiting.resort()
        self._grammars_ready()
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        swap_in: list[tuple[int, int]] = []
        preempted = self._preempt_for_priority(budget)
        running_preempted = False
        for c in self.connectors:
            c.begin_step()
        spec_tokens: dict[str, list[int]] = {}  # speculative decoding: each request's drafts
        draft_requests: dict[str, int] = {}  # a draft model drafts after the step for these
        unverified: dict[str, int] = {}  # ngram_gpu: drafts of unresolved steps counted
        load = len(self.running)  # the load speculation is decided at (and measured by)
        speculate = self.spec is not None and not self.spec.paused(load, self._admittable())

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            # (unverified drafts are counted in num_computed_tokens as if accepted: the step
            # after a step with k of them computes 1 new token - the one it samples - and
            # its own drafts; see the end of schedule())
            num_new = min(
                request.num_tokens
                + request.num_output_placeholders
                - (request.num_computed_tokens - request.num_unverified),
                budget,
            )
            for c in self._cutters:
                num_new = c.num_new_tokens(request, num_new)
            if num_new <= 0:
                i += 1
                continue
            drafts: list[int] = []
            if (
                speculate
                and num_new == 1
                and (request.num_output_placeholders == 0 or self.spec.device)  # type: ignore[union-attr]
            ):
                assert self.spec is not None
                drafts = self.spec.drafts_for(request, budget)
                num_new += len(drafts)  # verified in this step's forward pass
            # a draft model proposes after this step: slots for its drafts' KVs
            look = (
                self.spec.step_lookahead(request, num_new - len(drafts), len(drafts))
                if speculate and self.spec
                else 0
            )
            new_blocks = None
            gang_preempted = waits = False
            while True:
                new_blocks = self.kv_cache_manager.allocate_slots(
                    request, num_new, num_lookahead_tokens=look
                )
                if new_blocks is not None:
                    break
                if drafts or look:  # no room to speculate: a plain step before any preemption
                    num_new -= len(drafts)
                    drafts, look = [], 0
                    continue
                if self._room_made(request, num_new, num_scheduled, running_preempted):
                    running_preempted = waits = True  # no admissions while memory is short
                    break
                victim = self.running.pop_back()  # ranked last; never one already scheduled
                gang = self._preempt_group(victim, num_scheduled, new_reqs, cached_reqs)
                budget += gang.pop("_budget", 0)
                preempted.update(gang)
                running_preempted = gang_preempted = True
                if request.request_id in gang:
                    break
            if new_blocks is None:
                if waits:
                    i += 1
                    continue
                break
            num_scheduled[request.request_id] = num_new
            if request.num_unverified:
                unverified[request.request_id] = request.num_unverified
            if drafts:
                spec_tokens[request.request_id] = drafts
            if look:
                draft_requests[request.request_id] = look
            budget -= num_new
            self._add_to_output(request, new_blocks, new_reqs, cached_reqs)
            # a gang preemption may remove members before this one: find it again then
            i = self.running.index(request) + 1 if gang_preempted else i + 1

        while not running_preempted and len(self.waiting) > 0 and budget > 0:
            if len(self.running) >= self.config.max_num_seqs:
                break
            request = self._next_admissible()
            if request is None:
                break
            # A request about to fork n sequences (or beams) reserves all their slots.
            if len(self.running) + self._width(request) > self.config.max_num_seqs:
                break
            if request.swapped:
                pairs = self._swap_in(request, budget)
                if pairs is None:
                    break
                swap_in.extend(pairs)
                num_hit = request.num_computed_tokens
                num_new = min(request.num_tokens - num_hit, budget)
                new_blocks = self.kv_cache_manager.allocate_slots(request, num_new)
                assert new_blocks is not None  # _swap_in checked the room
            else:
                computed_blocks, num_hit = self.kv_cache_manager.get_computed_blocks(request)
                ext, hits = 0, []  # KV roles bring (host tier, transfer), each after the last's
                for c in self.connectors:
                    hits.append((c, num_hit + ext, c.external_hit(request, num_hit + ext)))
                    ext += hits[-1][2]
                num_new = request.num_tokens - num_hit - ext
                if not self.config.enable_chunked_prefill and num_new > budget:
                    break
                num_new = min(num_new, budget)
                for c in self._cutters:
                    num_new = c.num_new_tokens(request, num_new)
                look = 0
                if speculate and self.spec and num_hit + ext + num_new == request.num_tokens:
                    # its step ends with a sample: slots for a draft model's drafts after it
                    look = self.spec.step_lookahead(request, num_new, 0, num_hit + ext)
                new_blocks = self.kv_cache_manager.allocate_slots(
                    request, ext + num_new, computed_blocks, num_lookahead_tokens=look
                )
                if new_blocks is None and look:
                    look = 0
                    new_blocks = self.kv_cache_manager.allocate_slots(
                        request, ext + num_new, computed_blocks
                    )
                if new_blocks is None:
                    for c in self.connectors:
                        c.admission_blocked(request, num_new)
                    break
                if look:
                    draft_requests[request.request_id] = look
                self.kv_cache_manager.record_prefix_lookup(request.num_tokens, num_hit)
                for c, first, n in (h for h in hits if h[2]):
                    c.external_alloc(request, first, n)  # (its loads: this step's)
                num_hit += ext
            self.waiting.remove(request)
            request.mark_scheduled(num_hit)
            request.num_computed_tokens = num_hit
            request.status = RequestStatus.RUNNING
            self.running.add(request)
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            self._add_to_output(request, new_blocks, new_reqs, cached_reqs)

        kv_meta = {}
        if self.connectors:
            new_ids = [r.req_id for r in new_reqs]
            kv_meta = {c.name: c.build_metadata(num_scheduled, new_ids) for c in self.connectors}
        requests = self.requests
        batch = [requests[rid] for rid in num_scheduled]
        structured, structured_idx = self.grammar_book.batch_keys(
            batch, num_scheduled.values(), spec_tokens
        )
        step_id = next(self._step_ids)
        self._in_flight[step_id] = batch
        out = SchedulerOutput(
            step_id=step_id,
            structured_requests=structured,
            structured_batch_idx=structured_idx,
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=preempted,
            blocks_to_swap_out=self._swap_out,
            blocks_to_swap_in=swap_in,
            blocks_to_copy=self.kv_cache_manager.take_pending_copies(),
            kv_connector_metadata=kv_meta,
            # drafts of requests a later preemption did not take back out of the step
            scheduled_spec_tokens={r: d for r, d in spec_tokens.items() if r in num_scheduled},
            draft_requests={r: k for r, k in draft_requests.items() if r in num_scheduled},
            spec_paused=self.spec is not None and not speculate,
            device_drafts=self.spec is not None and self.spec.device,
            spec_unverified=unverified,
        )
        if out.scheduled_spec_tokens and not out.device_drafts:
            self._host_draft_steps.add(step_id)
        if self.spec is not None:
            self.spec.scheduled(out, t_start, load, speculate, arrivals=len(new_reqs))
        self.finished_req_ids = set()
        self._swap_out = []
        # Advance progress now: the runner computes exactly what was scheduled. A request
        # whose computed tokens catch up with its known ones samples a token this step: it
        # holds a placeholder for it until update_from_output brings the id.
        # Example (async): 10 known tokens, 1 placeholder (the last step's token, still on the
        # device), 10 computed -> 1 token scheduled (position 10, its id read on the device),
        # 11 computed = 10 + 1 -> a second placeholder, for the token at position 11.
        # With k drafts, 1 + k tokens are scheduled and the request samples (one placeholder):
        # e.g. 10 known tokens, 9 computed, 3 drafts -> 13 computed = 10 + 0 + 3.
        # ngram_gpu under async scheduling: the drafts count as unverified until the update
        # (as if all accepted); the next step is planned from there. Example: 10 known, 9
        # computed, 3 drafts -> 13 computed, 3 unverified, 1 placeholder; the next step
        # (before this one's samples are back): 10 + 1 - (13 - 3) = 1 new token and 3 drafts
        # -> 17 computed, 6 unverified, 2 placeholders. The update of the first step with 1
        # draft accepted: 12 known (2 new), 15 computed, 3 unverified, 1 placeholder.
        spec = out.scheduled_spec_tokens
        device = out.device_drafts
        for rid, n in num_scheduled.items():
            request = self.requests[rid]
            request.num_computed_tokens += n
            if rid in spec:
                request.num_unverified += len(spec[rid])
                if device and request.device_drafts_since is None:
                    request.device_drafts_since = step_id
            if (
                request.num_computed_tokens - request.num_unverified
                == request.num_tokens + request.num_output_placeholders
            ):
                request.num_output_placeholders += 1
        if self.connectors:
            prompt_tokens = out.total_num_scheduled_tokens > len(num_scheduled)
            for c in self.connectors:
                c.end_step(num_scheduled, prompt_tokens)
        return out

    def _room_made(
        self, request: Request, num_new: int, num_scheduled: dict[str, int], preempted: bool
    ) -> bool:
        """A running request found no blocks: whether a KV connector makes room with this
        step's plan (the request waits a step) instead of a preemption."""
        return any(c.make_room(request, num_new, num_scheduled, preempted) for c in self.connectors)

    def _add_to_output(
        self,
        request: Request,
        new_blocks: list,
        new_reqs: list[NewRequestData],
        cached_reqs: list[CachedRequestData],
    ) -> None:
        rid = request.request_id
        replaced = self.kv_cache_manager.take_replaced(rid)
        appended, request.pending_runner_tokens = request.pending_runner_tokens, []
        if rid in self._runner_has:
            new_ids = self.kv_cache_manager.new_block_ids(new_blocks)
            computed = request.num_computed_tokens
            cached_reqs.append(CachedRequestData(rid, new_ids, computed, replaced, appended))
            return
        self._runner_has.add(rid)
        new_reqs.append(
            NewRequestData(
                req_id=rid,
                prompt_token_ids=request.prompt_token_ids,
                output_token_ids=list(request.output_token_ids),
                sampling_params=request.sampling_params,
                block_ids=self.kv_cache_manager.get_block_table(rid),
                num_computed_tokens=request.num_computed_tokens,
                lora_int_id=lora_id_of(request),
            )
        )

    def _width(self, request: Request) -> int:
        """Running slots a request will take once it forks: n (or best_of) sequences, or the
        beam width, before its first token; 1 otherwise."""
        if request.num_output_tokens > 0 or request.parent_id is None:
            return 1
        if request.beam_group is not None:
            state = self.beams.states.get(request.beam_group)
            return state.k if state is not None else 1
        return num_sequences(request)

    def _next_admissible(self) -> Request | None:
        """The best-ranked waiting request whose grammar (if any) is ready: a request still
        compiling its grammar waits without blocking the others."""
        for request in self.waiting:
            # a request preempted while its last token is in flight waits for that token;
            # one whose LoRA adapter would exceed max_loras waits too
            if request.status != RequestStatus.WAITING_FOR_GRAMMAR and (
                request.num_output_placeholders == 0 and self.loras.fits(request, self.running)
            ):
                return request
        return None

    def _grammars_ready(self) -> None:
        """Let requests whose grammar compiled go on waiting for their turn; end those whose
        grammar failed (reported by the next update)."""
        for request in self.grammar_book.ready(self.waiting):
            self.waiting.remove(request)
            request.status = RequestStatus.FINISHED_ABORTED
            self._free_request(request)
            self.failed.append(request)

    def _preempt_group(
        self,
        victim: Request,
        num_scheduled: dict[str, int],
        new_reqs: list[NewRequestData],
        cached_reqs: list[CachedRequestData],
    ) -> dict:
        """Preempt ``victim`` and every other running sequence of its group (all-or-nothing),
        taking back the tokens of members already scheduled in this step. Returns the ids
        preempted (and, under "_budget", the tokens given back)."""
        out: dict = {}
        given_back = 0
        for member in self.groups.group_of(victim):
            if member is not victim:
                if member not in self.running:
                    continue
                self.running.remove(member)
            rid = member.request_id
            if rid in num_scheduled:
                given_back += num_scheduled.pop(rid)
                new_reqs[:] = [r for r in new_reqs if r.req_id != rid]
                cached_reqs[:] = [r for r in cached_reqs if r.req_id != rid]
            self._preempt(member)
            out[rid] = True
        out["_budget"] = given_back
        return out

    def _preempt_for_priority(self, budget: int) -> set[str]:
        """Priority policy: while the best waiting request outranks (strictly smaller priority
        value) the worst running one and cannot start because max_num_seqs is reached or the
        free blocks are fewer than its next chunk needs, preempt that running request."""
        preempted: set[str] = set()
        kv = self.kv_cache_manager
        while len(self.waiting) > 0 and len(self.running) > 0:
            head, victim = self._next_admissible(), self.running[-1]
            if head is None:
                break
            if not self.policy.may_preempt_for(head, victim):
                break
            if len(self.running) < self.config.max_num_seqs and kv.can_allocate(head, budget):
                break
            self.running.pop_back()
            gang = self._preempt_group(victim, {}, [], [])
            gang.pop("_budget")
            preempted.update(gang)
        return preempted

    def _swap_in(self, request: Request, budget: int) -> list[tuple[int, int]] | None:
        """Device room for a swapped request's blocks and its next tokens, then swap it in."""
        kv = self.kv_cache_manager
        if not kv.can_allocate(request, budget):
            return None
        pairs = kv.swap_in(request)
        request.swapped = False
        return pairs

    def _preempt(self, request: Request) -> None:
        """Preempt a running request: swap its blocks to host memory when swapping is the mode
        and there is room, else recompute (free the blocks and forget progress)."""
        swap = self.use_swap and all(c.may_swap(request) for c in self.connectors)
        pairs = self.kv_cache_manager.swap_out(request) if swap else None
        if pairs is not None:
            self._swap_out.extend(pairs)
            request.swapped = True
            self.num_swaps += 1
        else:
            self.kv_cache_manager.free(request)
            request.num_computed_tokens = 0
        for c in self.connectors:
            c.on_preempt(request, request.swapped)
        if not request.swapped:  # (swapped, its unverified drafts stay counted until the update)
            request.num_unverified = 0
        request.device_drafts_since = None  # the runner drops its row
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        if request.request_id in self._runner_has:
            self._runner_has.discard(request.request_id)
            self.finished_req_ids.add(request.request_id)  # the runner drops its state
        self.waiting.add(request)

    # ------------------------------------------------------------------------- results
    def send_grammar_tokens(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> None:
        """Give the step's sampled tokens of structured requests to ``Grammars`` now, before
        ``update_from_output`` (which then does not): async steps submit the next grammar
        step right away, so its work overlaps the update. A token that also ends its request
        (EOS, max_tokens) is accepted too, harmlessly: the matcher is dropped after it. Not
        for steps with forks or beams (their grammar operations are ordered by the update;
        those requests run synchronous steps)."""
        self.grammar_book.send_tokens(scheduler_output, runner_output)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop conditions, free finished requests. A request that
        verified drafts keeps the accepted ones and the model's token after them (see
        ``SchedulerOutput.scheduled_spec_tokens`` and ``core/sched/spec.py``)."""
        try:
            return self._update_from_output(scheduler_output, runner_output)
        finally:
            self.grammar_book.end_update()

    def _update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        meta, landed = scheduler_output.kv_connector_metadata, runner_output.kv_connector_output
        for c in self.connectors:  # (first: a role may end requests, reported below)
            c.update(meta.get(c.name), landed.get(c.name))
        outputs = [
            EngineCoreOutput(r.request_id, [], finish_reason="abort", error=r.error,
                             parent_id=r.parent_id, seq_index=r.seq_index)
            for r in self.failed
        ]  # fmt: skip
        self.failed = []
        sampled = dict(zip(runner_output.req_ids, range(len(runner_output.req_ids))))
        spec_tokens = scheduler_output.scheduled_spec_tokens
        # the speculation pacer looks at each decoding request while speculating; paused, only
        # at those its shadow drafts follow (or while it has room): a few calls, not 256
        pacer = self.spec.pacer if self.spec is not None else None
        paused = scheduler_output.spec_paused
        followed = pacer.followed if pacer is not None else {}
        room = pacer is not None and pacer.shadow_drafts and pacer.has_room()
        self._host_draft_steps.discard(scheduler_output.step_id)
        for request in self._in_flight.pop(scheduler_output.step_id):
            if request.is_finished:
                continue  # aborted (or finished by a stop string) while the step ran
            rid = request.request_id
            idx = sampled.get(rid)
            token_ids = runner_output.sampled_token_ids[idx] if idx is not None else []
            if token_ids:
                request.num_output_placeholders -= 1
            drafts = spec_tokens.get(rid)
            if drafts and token_ids:
                assert self.spec is not None
                # a = drafts accepted: K/V stay valid up to the last one; the new tokens are
                # samples 0..a. Example: 10 known tokens, drafts [5, 9, 2] (13 computed),
                # samples [5, 9, 7, 4] -> a = 2, new tokens [5, 9, 7], 12 computed.
                # Drafts made on the device: the scheduled ones are placeholders; the row
                # verified those the lookup found (fewer when it found fewer).
                verified = (
                    runner_output.device_draft_tokens.get(rid, [])
                    if scheduler_output.device_drafts
                    else drafts
                )
                a = self.spec.accept(verified, token_ids)
                token_ids = token_ids[: a + 1]
                if request.num_unverified >= len(drafts):  # (0: preempted meanwhile, recompute)
                    request.num_unverified -= len(drafts)
                    request.num_computed_tokens -= len(drafts) - a
                    for c in self.connectors:
                        c.on_drafts_verified(request, len(drafts), a)
            prompt_lp = runner_output.prompt_logprobs.get(rid)
            if not token_ids and prompt_lp is None:
                continue  # a prefill chunk that did not reach the end of the prompt
            if request.beam_group is not None:
                lps = runner_output.logprobs
                outputs.extend(
                    self._beam_step(request, lps[idx] if lps and idx is not None else None)
                )
                continue
            forked = runner_output.forked_token_ids.get(rid)
            if forked:
                outputs.extend(self._fork(request, forked, runner_output))
            new_tokens: list[int] = []
            for tok in token_ids:
                request.append_output_token_ids(tok)
                new_tokens.append(tok)
                if check_stop(request, tok, self.max_model_len) or self.grammar_book.accept(
                    request, tok
                ):
                    break
            since = request.device_drafts_since
            if since is not None and scheduler_output.step_id >= since:
                # drafts made on the device: the runner holds none of its samples on the host
                # (under async scheduling it does not know where they go when it samples)
                request.pending_runner_tokens.extend(new_tokens)
            elif len(new_tokens) > 1 and not request.is_finished:
                # the runner holds sample 0; it learns the accepted ones at the next step
                request.pending_runner_tokens.extend(new_tokens[1:])
            logprobs = None
            if runner_output.logprobs is not None and idx is not None:
                lp = runner_output.logprobs[idx]
                logprobs = lp[: len(new_tokens)] if lp is not None else None
            if (
                pacer is not None
                and (not paused or room or rid in followed)
                and scheduler_output.num_scheduled_tokens.get(rid) == 1 + len(drafts or ())
            ):  # a decode (not a prompt's last chunk)
                self.spec.observe(request, paused, bool(drafts))
            outputs.append(self._emit(request, new_tokens, logprobs, prompt_lp))
        if self.spec is not None and self.spec.pacer is not None:
            busy = self.has_unfinished_requests()
            self.spec.pacer.updated(scheduler_output.step_id, time.perf_counter(), busy)
        for rid, n in runner_output.device_draft_found.items():
            request = self.requests.get(rid)
            if request is not None:
                request.device_drafts_found = n
        if runner_output.draft_token_ids:
            assert self.spec is not None
            for rid, (num_tokens, drafts) in runner_output.draft_token_ids.items():
                request = self.requests.get(rid)
                if request is not None and not request.is_finished:
                    self.spec.store(rid, num_tokens, drafts)
        return outputs

    def _emit(
        self,
        request: Request,
        new_tokens: list[int],
        logprobs: list | None,
        prompt_lp: tuple | None = None,
    ) -> EngineCoreOutput:
        """The step's output for one request; a request that finished is freed here."""
        out = EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=new_tokens,
            new_logprobs=logprobs,
            new_prompt_logprobs=prompt_lp,
            finish_reason=request.get_finished_reason(),
            stop_reason=request.stop_reason,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            parent_id=request.parent_id,
            seq_index=request.seq_index,
            timing=request.first_timing() if new_tokens else None,
        )
        if request.is_finished:
            if request in self.running:
                self.running.remove(request)
            else:  # preempted while this step was in flight (async scheduling): waiting
                self.waiting.remove(request)
            self._free_request(request)
        return out

    def _beam_step(self, request: Request, logprobs: list | None) -> list[EngineCoreOutput]:
        """Feed a beam's logprobs to its search; apply the search's forks and drops."""
        forks, dropped, final = self.beams.on_step(request, logprobs, self.requests)
        for child in forks:
            self._track(child)
            self.running.add(child)
        for r in dropped:
            if r in self.running:
                self.running.remove(r)
            self._free_request(r)
        return [final] if final is not None else []

    def _fork(
        self, parent: Request, tokens: list[int], runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Create the other sequences of ``parent`` (parallel sampling) after its prefill, each
        with its first token; outputs for them, and those that finish at once are freed."""
        children = self.groups.fork(parent, tokens, self.kv_cache_manager)
        lps = runner_output.forked_logprobs.get(parent.request_id)
        outputs = []
        for j, child in enumerate(children):
            self._track(child)
            self.running.add(child)
            tok = child.output_token_ids[-1]
            self.grammar_book.fork(parent, child)  # before the parent accepts its token
            check_stop(child, tok, self.max_model_len) or self.grammar_book.accept(child, tok)
            outputs.append(self._emit(child, [tok], [lps[j]] if lps else None))
        return outputs

    def apply_grammar_step(self, step: GrammarStep) -> list[EngineCoreOutput]:
        """End the requests whose token a grammar rejected (a bitmask should never let one
        through: this is a safety net), each with an error output."""
        return self.grammar_book.apply_step(
            step,
            lambda r: self.finish_requests([r.request_id], RequestStatus.FINISHED_ABORTED),
        )

    def rollback_structured(self, request_id: str, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens in a request's grammar matcher (for
        rejected speculative tokens)."""
        self.grammar_book.rollback(self.requests[request_id], num_tokens)

    # --------------------------------------------------------------------------- stats
    def make_stats(self) -> dict[str, float]:
        """Counters and gauges for metrics: queue sizes, KV usage, preemptions, prefix hits."""
        kv = self.kv_cache_manager
        return {
            "num_running_reqs": len(self.running),
            "num_waiting_reqs": len(self.waiting),
            "kv_cache_usage": kv.usage,
            "num_preemptions": self.num_preemptions,
            "prefix_cache_queries": kv.prefix_cache_queries,
            "prefix_cache_hits": kv.prefix_cache_hits,
            "num_swaps": self.num_swaps,
            **{k: v for c in self.connectors for k, v in c.stats().items()},
            **(self.spec.stats() if self.spec is not None else {}),
            "time": time.monotonic(),
        }
