"""The iteration-level scheduler.

THE RULE. There is no prefill phase and no decode phase. Every request has
``num_computed_tokens`` (tokens whose K/V are in the cache) and ``num_tokens`` (prompt + output
so far). Each step hands out one token budget, ``max_num_batched_tokens``, so that requests catch
up: first the running requests, in policy order (a decode needs 1 token, an unfinished prompt
gets the rest of the budget, chunked), then the waiting requests, in policy order, while the
budget, ``max_num_seqs`` and the KV cache allow. When a running request cannot get a block, the
running request ranked last (for FCFS: the most recently arrived) is preempted: by recompute
(its blocks are freed, ``num_computed_tokens`` goes back to 0; with prefix caching its full
blocks stay cached, so resuming is mostly a cache hit) or by swap (its blocks are copied to host
memory and back on resume); it waits again at the place its rank gives it (for FCFS: the
front). No waiting request is admitted in a step whose running phase preempted. Under the
priority policy a waiting request may, before the running phase, preempt running requests of
a strictly larger priority value when memory or max_num_seqs is short (see
``_preempt_for_priority``).

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
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pagedllm.config import CacheConfig, KVCompressConfig, SchedulerConfig
from pagedllm.core.kv_cache.factory import make_kv_cache_manager
from pagedllm.core.kv_cache.spec import KVCacheGroups
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched.beams import BeamManager
from pagedllm.core.sched.checks import check_admissible, check_stop
from pagedllm.core.sched.groups import SequenceGroups, num_sequences
from pagedllm.core.sched.output import (
    CachedRequestData,
    EngineCoreOutput,
    KVCEviction,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from pagedllm.core.sched.policy import Now, RankedQueue, make_policy
from pagedllm.core.sched.spec import SpecDecoding
from pagedllm.core.sched.structured import GrammarBook

if TYPE_CHECKING:
    from pagedllm.spec_decode import SpeculativeConfig
    from pagedllm.structured_output.grammars import Grammars, GrammarStep


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
    ) -> None:
        self.config = scheduler_config
        # KV-Compress: when on, the KV manager is the per-head one (core/kv_cache/head_paged)
        self.kvc = kvc_config if kvc_config is not None and kvc_config.enabled else None
        if self.kvc is not None and (kv_groups is None or kv_groups.head_paged is None):
            raise ValueError("KV-Compress needs the model runner's per-head KV-cache groups.")
        # request -> [its evictions whose new lengths have not come back yet, the blocks they
        # free at least] (async scheduling plans the next step meanwhile, on the old lengths:
        # see ``_kvc_plan``; ``_kvc_make_room`` counts the blocks)
        self._kvc_inflight: dict[str, list[int]] = {}
        # KV-Compress: the free blocks the next schedule() wants at its start - what memory
        # stopped the last one short of, or its prompts' next chunks; see
        # ``wants_evictions_landed``
        self._kvc_wanted = 0
        # KV-Compress: the requests with a budget (or a measured prefix): without any, a step
        # plans no eviction unless memory is short (no per-request pass over the batch)
        self._kvc_budgeted: set[str] = set()
        self.max_model_len = scheduler_config.max_model_len
        # speculative decoding: drafts before a step, acceptance after it (core/sched/spec.py)
        self.spec = SpecDecoding(spec_config, self.max_model_len) if spec_config else None
        # the KV manager for the model's KV-cache groups (a single table when none are given)
        self.kv_cache_manager = make_kv_cache_manager(
            kv_groups,
            num_blocks,
            cache_config.block_size,
            cache_config.enable_prefix_caching,
            num_host_blocks,
            scheduler_config.max_num_batched_tokens,
        )
        # KV-Compress: the (layer, KV head) pairs a budget counts
        self._kvc_heads = (
            int(self.kv_cache_manager.compressible.sum()) if self.kvc is not None else 0
        )
        mode = cache_config.preemption_mode
        self.use_swap = mode == "swap" or (mode == "auto" and swap_is_cheaper)
        self.clock = clock
        # "now" for the waiting queue's ranks, in a holder the queue's key closes over: a
        # closure over self would make a reference cycle, which only the cyclic collector
        # frees (and a CUDA engine freezes the collector's view after start-up)
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
        # Requests finished since the last schedule(): the runner drops their state.
        self.finished_req_ids: set[str] = set()
        # Requests the runner holds state for (scheduled at least once since last (re)start).
        self._runner_has: set[str] = set()
        self.num_preemptions = 0
        # Live requests that need their sampled tokens on the host before their next step
        # (see Request.needs_host_tokens): while any exists, the engine runs synchronously.
        self._sync_ids: set[str] = set()
        # The Request objects of each scheduled step, in batch order, until its update (two
        # steps are in flight under async scheduling; a request that finished may have a
        # token in flight while a new request already uses its id).
        self._in_flight: dict[int, list[Request]] = {}
        self._step_ids = itertools.count()

    # ----------------------------------------------------------------- requests in and out
    def add_request(self, request: Request) -> None:
        """Queue a validated request. Raises ValueError if it could never be served."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use.")
        params = request.sampling_params
        if self.kvc is None and params.uses_kvc_fields:
            raise ValueError(
                "max_cache_tokens, compression_rate, protected_window_size and compress_once "
                "need an engine started with KV-Compress (enable_kvc / --enable-kvc)."
            )
        capacity = self.kv_cache_manager.token_capacity()
        check_admissible(request, self.config.max_num_seqs, self.max_model_len, capacity)
        request.status = RequestStatus.WAITING
        if request.sampling_params.structured_outputs is not None:
            self.grammar_book.submit(request)
        self.groups.register(request)
        self._track(request)
        self.waiting.add(request)

    @property
    def structured(self) -> Any:
        """The StructuredOutputManager (grammar compiler), set by the engine core when needed."""
        return self.grammar_book.structured

    @structured.setter
    def structured(self, manager: Any) -> None:
        self.grammar_book.structured = manager

    @property
    def grammars(self) -> Grammars | None:
        """``Grammars``: the matchers of structured requests (set by the engine core)."""
        return self.grammar_book.grammars

    @grammars.setter
    def grammars(self, grammars: Grammars | None) -> None:
        self.grammar_book.grammars = grammars

    def _track(self, request: Request) -> None:
        self.requests[request.request_id] = request
        if self.kvc is not None:
            rule = request.kvc_budget_rule = self.kvc.budget_of(request.sampling_params)
            if rule != (None, None) or request.sampling_params.kvc_compress_at is not None:
                self._kvc_budgeted.add(request.request_id)
        if request.needs_host_tokens:
            self._sync_ids.add(request.request_id)

    @property
    def needs_sync(self) -> bool:
        """Whether some live request needs synchronous steps (no async scheduling), or
        speculative decoding with drafts made on the host is on and not paused by the load (a
        draft follows the last sampled token, which must be on the host; ngram_gpu drafts on
        the device). KV-Compress evictions do not: their lengths come back a step later."""
        return bool(self._sync_ids) or (
            self.spec is not None
            and not self.spec.device
            and not self.spec.paused(len(self.running), self._admittable())
        )

    def wants_evictions_landed(self) -> bool:
        """Under async scheduling: whether the next step should wait for the last step's
        results before it is scheduled (the engine core then takes its results first). True
        when KV-Compress evictions are in flight and the pool has fewer blocks free than the
        next step wants: what the last ``schedule()`` was short of when memory stopped it,
        or else the blocks of the prompt tokens it left for the next step (the rest of the
        prompts it cut, then the first waiting request's, up to the token budget). Those
        evictions free blocks the next step would otherwise go without.

        Why: the blocks an eviction frees reach the host a step late. With long prompts each
        admission waited for the eviction of the prompt before it: a prompt every other
        step, a decode-only step between them, the pool holding two uncompressed prompts
        instead of one. The engine on a CPU (4 layers x 8 KV heads, 128 prompts of 3,000,
        budget 176, the pool 5.4 prompts): 687 steps and 46.8 sequences a step without
        this, 551 and 58.2 with it (86 steps took their results first; synchronous steps:
        623 and 51.4). Waiting idles the device for the host's update, schedule and launch
        of a step: 8-16 ms on an H200 at Benchmark D's shape, ~2 s of a 50-110 s run.

        Example (bs 16, 2 heads, a token budget of 6,000): the last schedule computed a
        6,000-token prompt whole, a second one waiting -> it wants 375 x 2 blocks; 600 are
        free now and the first prompt's eviction is in flight -> True."""
        if not self._kvc_inflight or not self._kvc_wanted:
            return False
        return self.kv_cache_manager.num_free_blocks() < self._kvc_wanted

    def _admittable(self) -> int:
        """Waiting requests that a free seat could take now (``max_num_seqs`` bounds them):
        the speculation pacer pauses while a burst of them is being admitted. A queue behind
        full seats does not count: speculating frees the seats sooner.

        Example: max_num_seqs 16, 12 running, 9 waiting -> 4."""
        return min(len(self.waiting), max(self.config.max_num_seqs - len(self.running), 0))

    def finish_requests(self, request_ids: list[str] | str, status: RequestStatus) -> None:
        """End requests from outside the loop (abort, or a stop string found by the
        detokenizer). Unknown or already finished ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
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

    def _free_request(self, request: Request) -> None:
        if self.spec is not None:
            self.spec.finish(request)
        self.grammar_book.release(request)
        self.kv_cache_manager.free(request)
        self.requests.pop(request.request_id, None)
        self._kvc_budgeted.discard(request.request_id)
        self._kvc_inflight.pop(request.request_id, None)
        self._sync_ids.discard(request.request_id)
        self.groups.finished(request)
        if request.request_id in self._runner_has:
            self._runner_has.discard(request.request_id)
            self.finished_req_ids.add(request.request_id)

    def fail_in_flight(self, everything: bool = False) -> list[str]:
        """After a step failed (in the executor, or in this scheduler mid-step): end every
        request whose KV or tokens that step may have left wrong - the running ones, those of
        the steps in flight, and the swapped ones (their copy out may have been in it) - and
        forget the steps in flight. Requests still waiting for their first step (or to
        recompute after a preemption) are untouched unless ``everything``: they run as if
        nothing happened. The caller resets the runner, which then holds no request. The
        prefix cache is emptied: a block cached in the failed step may never have been
        written. Returns the ids callers gave the ended requests (a request with n > 1 or a
        beam search counts once)."""
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
        self._swap_out = []
        self.kv_cache_manager.take_pending_copies()
        self._kvc_inflight.clear()
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
        kvm = self.kv_cache_manager
        self._kvc_wanted = 0
        free_start = kvm.num_free_blocks() if self.kvc is not None else 0
        kvc_room: dict[str, int] = {}  # KV-Compress: requests to evict from for room
        kvc_short = False  # memory is short and those evictions make room: requests wait
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
            num_new = self._kvc_cut(request, num_new)
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
                self._draft_lookahead(request, num_new - len(drafts), len(drafts), speculate)
                if speculate
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
                if kvc_short:
                    waits = True  # for the blocks this step's evictions free
                    break
                if self.kvc is not None and not running_preempted:
                    # evict from running requests over their budget, rather than preempt; this
                    # request waits for the blocks that frees (next step), the others that
                    # need no new block run
                    short = kvm.blocks_short(request, num_new)
                    # (the blocks this step has taken so far count: the next step takes them
                    # again before it reaches this request)
                    self._kvc_wanted = free_start + short
                    if self._kvc_make_room(kvc_room, num_scheduled, short):
                        running_preempted = True  # no admissions while memory is short
                        kvc_short = waits = True
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
                num_new = request.num_tokens - num_hit
                if not self.config.enable_chunked_prefill and num_new > budget:
                    break
                num_new = self._kvc_cut(request, min(num_new, budget))
                look = 0
                if num_hit + num_new == request.num_tokens:  # its step ends with a sample
                    look = self._draft_lookahead(request, num_new, 0, speculate, num_hit)
                new_blocks = self.kv_cache_manager.allocate_slots(
                    request, num_new, computed_blocks, num_lookahead_tokens=look
                )
                if new_blocks is None and look:
                    look = 0
                    new_blocks = self.kv_cache_manager.allocate_slots(
                        request, num_new, computed_blocks
                    )
                if new_blocks is None:
                    if self.kvc is not None:
                        self._kvc_wanted = free_start + kvm.blocks_short(request, num_new)
                    break
                if look:
                    draft_requests[request.request_id] = look
                self.kv_cache_manager.record_prefix_lookup(request.num_tokens, num_hit)
            self.waiting.remove(request)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            request.num_computed_tokens = num_hit
            request.status = RequestStatus.RUNNING
            self.running.add(request)
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            self._add_to_output(request, new_blocks, new_reqs, cached_reqs)

        kvc_compress = self._kvc_plan(num_scheduled, kvc_room) if self.kvc is not None else []
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
            kvc_compress=kvc_compress,
            # drafts of requests a later preemption did not take back out of the step
            scheduled_spec_tokens={r: d for r, d in spec_tokens.items() if r in num_scheduled},
            draft_requests={r: k for r, k in draft_requests.items() if r in num_scheduled},
            spec_paused=self.spec is not None and not speculate,
            device_drafts=self.spec is not None and self.spec.device,
            spec_unverified=unverified,
        )
        if self.spec is not None and self.spec.pacer is not None:
            # the step's prompt tokens: the rows longer than a decode row (its token and its
            # drafts) are prompt chunks (or a preempted request's recompute); none where the
            # step is as long as its decode rows (no Python pass over 256 rows then)
            prompt_tokens = 0
            decode_len = len(num_scheduled) + sum(map(len, out.scheduled_spec_tokens.values()))
            if out.total_num_scheduled_tokens != decode_len:
                prompt_tokens = sum(
                    n for rid, n in num_scheduled.items() if n > 1 + len(spec_tokens.get(rid, ()))
                )
            self.spec.pacer.scheduled(
                step_id, t_start, load, speculate, prompt_tokens, arrivals=len(new_reqs)
            )
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
        kvc = self.kvc is not None
        prompt_left = 0  # KV-Compress: prompt tokens left for the next step
        for rid, n in num_scheduled.items():
            request = self.requests[rid]
            request.num_computed_tokens += n
            if kvc and n > 1 and request.num_computed_tokens < request.num_tokens:
                prompt_left += request.num_tokens - request.num_computed_tokens
            if rid in spec:
                request.num_unverified += len(spec[rid])
                if device and request.device_drafts_since is None:
                    request.device_drafts_since = step_id
            if (
                request.num_computed_tokens - request.num_unverified
                == request.num_tokens + request.num_output_placeholders
            ):
                request.num_output_placeholders += 1
        if kvc:
            self._kvc_want_prompts(prompt_left)
        return out

    def _kvc_want_prompts(self, prompt_left: int) -> None:
        """``_kvc_wanted`` at least the blocks of the next step's prompt tokens: the
        ``prompt_left`` tokens of the prompts this step cut, then the first waiting
        request's (while a seat is free), up to the token budget.
        Example: budget 8,192, 2,000 tokens left of a prompt and a 6,000-token one waiting
        -> the blocks of 8,000 tokens (``blocks_for_tokens``)."""
        tokens = prompt_left
        if self.waiting and len(self.running) < self.config.max_num_seqs:
            first = self.waiting.peek()
            tokens += first.num_tokens - first.num_computed_tokens
        tokens = min(tokens, self.config.max_num_batched_tokens)
        if tokens:
            need = self.kv_cache_manager.blocks_for_tokens(tokens)
            self._kvc_wanted = max(self._kvc_wanted, need)

    def _draft_lookahead(
        self,
        request: Request,
        num_new: int,
        num_drafts: int,
        speculate: bool,
        num_computed: int | None = None,
    ) -> int:
        """Lookahead slots for the drafts a draft model writes after this step, when the
        request's step (``num_new`` known tokens from ``num_computed`` on, then
        ``num_drafts`` drafts to verify) ends with a sample; 0 otherwise.

        Example: 40 known tokens, 39 computed, 1 new + 3 drafts -> positions up to 42 are
        computed in the step -> slots for k more from position 43 on (the new token after the
        accepted drafts is at most at 43: the draft model's KVs go from there)."""
        if not speculate or self.spec is None or not self.spec.uses_runner:
            return 0
        computed = request.num_computed_tokens if num_computed is None else num_computed
        if computed + num_new != request.num_tokens + request.num_output_placeholders:
            return 0  # a prefill chunk before the prompt's end: nothing to draft after
        return self.spec.lookahead(request, computed + num_new + num_drafts)

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
            cached_reqs.append(
                CachedRequestData(
                    rid,
                    self.kv_cache_manager.new_block_ids(new_blocks),
                    request.num_computed_tokens,
                    replaced,
                    appended,
                )
            )
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
            # a request preempted while its last token is in flight waits for that token
            if request.status != RequestStatus.WAITING_FOR_GRAMMAR and (
                request.num_output_placeholders == 0
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
        # (a request whose eviction is still on the device is recomputed: its blocks on the
        # host would be the ones from before the eviction)
        swap = self.use_swap and request.request_id not in self._kvc_inflight
        pairs = self.kv_cache_manager.swap_out(request) if swap else None
        if pairs is not None:
            self._swap_out.extend(pairs)
            request.swapped = True
            self.num_swaps += 1
        else:
            self.kv_cache_manager.free(request)
            request.num_computed_tokens = 0
            request.kvc_compressed_at = -1  # its KVs are computed again, uncompressed
            self._kvc_inflight.pop(request.request_id, None)
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
        outputs: list[EngineCoreOutput] = [
            EngineCoreOutput(
                r.request_id,
                [],
                finish_reason="abort",
                error=r.error,
                parent_id=r.parent_id,
                seq_index=r.seq_index,
            )
            for r in self.failed
        ]
        self.failed = []
        inflight = self._kvc_inflight
        for e in scheduler_output.kvc_compress:
            # (a request preempted or finished since has forgotten the eviction)
            entry = inflight.get(e.req_id)
            if entry is not None:
                entry[0] -= 1
                entry[1] -= self._kvc_frees(e.held, e.budget)
                if not entry[0]:
                    del inflight[e.req_id]
                request = self.requests[e.req_id]
                lens = runner_output.kvc_lens[e.req_id]
                self.kv_cache_manager.apply_compaction(request, lens, e.computed)
        sampled = dict(zip(runner_output.req_ids, range(len(runner_output.req_ids))))
        spec_tokens = scheduler_output.scheduled_spec_tokens
        # the speculation pacer looks at each decoding request while speculating; paused,
        # only at those its shadow drafts follow (or while it has room for more): a step of
        # 256 requests then makes a few calls, not 256
        pacer = self.spec.pacer if self.spec is not None else None
        paused = scheduler_output.spec_paused
        followed = pacer.followed if pacer is not None else {}
        room = pacer is not None and pacer.shadow_drafts and pacer.has_room()
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

    # ---------------------------------------------------------------------- KV-Compress
    def kvc_budget(self, request: Request, num_tokens: int) -> int | None:
        """KVs the request's compressible heads may keep at ``num_tokens`` tokens: its
        ``max_cache_tokens`` x compressible (layer, KV head) pairs, or ``num_tokens`` x pairs /
        ``compression_rate`` (rounded up); None when it has neither (never compressed)."""
        assert self.kvc is not None
        rule = request.kvc_budget_rule
        if rule is None:
            rule = request.kvc_budget_rule = self.kvc.budget_of(request.sampling_params)
        m, rate = rule
        if m is not None:
            return m * self._kvc_heads
        if rate is not None:
            return math.ceil(num_tokens * self._kvc_heads / rate)
        return None

    def _kvc_cut(self, request: Request, num_new: int) -> int:
        """A chunk ends at the request's ``kvc_compress_at`` token (evicted after it)."""
        at = request.sampling_params.kvc_compress_at
        if at is not None and request.num_computed_tokens < at:
            return min(num_new, at - request.num_computed_tokens)
        return num_new

    def _kvc_protected(self, request: Request) -> int:
        p = request.sampling_params.protected_window_size
        return self.kvc.protected_window_size if p is None else p

    def _kvc_over(self, request: Request, num_tokens: int) -> int | None:
        """The budget when the request holds more KVs than it (else None). A protected
        cached prefix counts in neither (``HeadPagedKVCacheManager.settle_prefix``)."""
        kvm = self.kv_cache_manager
        prefix = kvm.prefix_tokens(request.request_id)
        budget = self.kvc_budget(request, num_tokens - prefix)
        if budget is None or kvm.held_kvs(request.request_id) <= budget:
            return None
        return budget

    def _kvc_make_room(
        self, room: dict[str, int], num_scheduled: dict[str, int], short: int
    ) -> bool:
        """Memory is short by ``short`` blocks: mark running requests over their budget that
        grew since their last eviction for eviction after this step - those grown by at least
        a block's tokens (every one of them, most grown first), and the others only when those
        cannot free ``short`` blocks. False, marking none, when even evicting all of them down
        to their budgets could not free ``short`` blocks (then the scheduler preempts:
        evicting a few KVs each step for a request that still would not fit only stalls it).

        Why a block's growth: each eviction costs host and device work per request, and a
        request grown by g tokens frees about g / bs blocks a head. Evicting every request
        grown by a token or two, step after step, took ~7 ms of host time a step at 226
        running (H200, 8B shape, input 500, budget 128) to free a block a head here and there.
        A request whose eviction is still on the device is skipped (its lengths on the host
        are the old ones until it comes back), but what that eviction frees counts: True,
        marking none, when evictions in flight free ``short`` blocks (the request waits a
        step for them; at input 6,000 the eviction of a prompt just computed frees a fifth of
        a 4 GiB cache, and preempting a request instead re-ran its prompt).

        Freed blocks, at least: a request ``e`` KVs over its budget frees ``ceil(e / bs)``
        blocks (``_kvc_frees``).
        Example: bs 16, growth 40, 3 and 20 tokens -> the first and third are marked; the
        second too only if those two free fewer than ``short`` blocks."""
        bs = self.kv_cache_manager.block_size
        grown: list[tuple[int, Request, int]] = []  # (growth, request, tokens after the step)
        for r in self.running:
            rid = r.request_id
            if rid in room or rid not in self._runner_has or rid in self._kvc_inflight:
                continue
            after = r.num_computed_tokens + num_scheduled.get(rid, 0)
            if after > r.kvc_compressed_at:  # (an eviction at its length freed what it could)
                grown.append((after - r.kvc_compressed_at, r, after))
        grown.sort(key=lambda g: -g[0])
        chosen: dict[str, int] = {}
        freeable = sum(blocks for _, blocks in self._kvc_inflight.values())
        for growth, r, after in grown:
            if growth < bs and freeable >= short:
                break
            budget = self._kvc_over(r, after)
            if budget is not None:
                chosen[r.request_id] = budget
                freeable += self._kvc_frees(self.kv_cache_manager.held_kvs(r.request_id), budget)
        if freeable < short or not (chosen or self._kvc_inflight):
            return False
        room.update(chosen)
        return True

    def _kvc_frees(self, held: int, budget: int) -> int:
        """Blocks an eviction of a request holding ``held`` KVs down to ``budget`` frees, at
        least: each evicted chunk frees one block and holds at most bs KVs.
        Example: bs 16, 1,000 KVs over -> 63 blocks."""
        return -(-max(held - budget, 0) // self.kv_cache_manager.block_size)

    def _kvc_plan(self, num_scheduled: dict[str, int], room: dict[str, int]) -> list[KVCEviction]:
        """The evictions after this step: a request whose prompt is done this step (it
        samples for the first time since its KVs were computed), one due for continual
        compression (``compress_once`` off: every ``compression_interval`` decode steps), and
        those ``_kvc_make_room`` chose; each only when it holds more KVs than its budget.

        Under async scheduling a step is planned before the last step's evictions come back:
        the evicted requests' lengths, blocks and held KVs on the host are then the old ones,
        which bound the new ones (a head only loses KVs). That is safe: the blocks a request
        held before an eviction (all of which it keeps until the lengths come back) hold every
        KV the device keeps, the next step's slots come from the device's own lengths, and an
        eviction planned meanwhile gets bounds (sort width, moves) at least the true ones.
        ``apply_compaction`` then adds the tokens allocated since the eviction to its
        lengths."""
        assert self.kvc is not None
        plan: list[KVCEviction] = []
        if not room and not self._kvc_budgeted:
            return plan
        chosen = dict(room)
        for rid, n in num_scheduled.items():
            if rid in chosen:
                continue
            r = self.requests[rid]
            at = r.sampling_params.kvc_compress_at
            if at is None and r.kvc_budget_rule == (None, None):
                continue  # no budget: never evicted (e.g. KV-Compress on, a plain request)
            after = r.num_computed_tokens + n
            if at is not None and after == at and r.kvc_compressed_at < 0:
                r.kvc_compressed_at = after  # the measured prefix: evict now, then never
                budget = self._kvc_over(r, after)
                if budget is not None:
                    chosen[rid] = budget
                continue
            if after != r.num_tokens + r.num_output_placeholders:
                continue  # a prefill chunk short of the prompt's end
            if at is not None:
                continue
            p = r.sampling_params
            once = self.kvc.compress_once if p.compress_once is None else p.compress_once
            if r.kvc_compressed_at < 0:  # its prompt's KVs are all computed this step
                r.kvc_compressed_at = after
            else:
                r.kvc_steps += 1
                if once or r.kvc_steps < self.kvc.compression_interval:
                    continue
            budget = self._kvc_over(r, after)
            if budget is not None:
                chosen[rid] = budget
        kvm = self.kv_cache_manager
        for rid in chosen:
            r = self.requests[rid]
            after = r.num_computed_tokens + num_scheduled.get(rid, 0)
            r.kvc_compressed_at, r.kvc_steps = after, 0
            # the blocks it shares through the prefix cache are protected from now on; the
            # budget counts the KVs after them (the device counts all: add them back)
            prefix = kvm.settle_prefix(r)
            budget = self._kvc_over(r, after)
            if budget is None:
                continue
            # its own cached prompt blocks: copied first where there is room (the cache
            # keeps them for later requests), else out of the cache
            copy_to, copy_src = kvm.detach_own(r, keep_cached=True) or (None, None)
            max_len, held = kvm.head_extent(rid)
            shared = prefix * self._kvc_heads
            protect = after - self._kvc_protected(r)
            plan.append(
                KVCEviction(
                    rid,
                    budget + shared,
                    protect,
                    max_len,
                    held + shared,
                    keep_below=prefix,
                    copy_to=copy_to,
                    copy_src=copy_src,
                    computed=after,
                )
            )
            entry = self._kvc_inflight.setdefault(rid, [0, 0])
            entry[0] += 1
            entry[1] += self._kvc_frees(held + shared, budget + shared)
        return plan

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
            "kvc_compressions": getattr(kv, "num_compressions", 0),
            "kvc_evicted_kvs": getattr(kv, "num_evicted_kvs", 0),
            **(self.spec.stats() if self.spec is not None else {}),
            "time": time.monotonic(),
        }
