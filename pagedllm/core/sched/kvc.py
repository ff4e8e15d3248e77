"""KV-Compress, scheduler role: every rule of when a request's KVs are evicted, and to what.

A request with a budget (``max_cache_tokens`` KVs per compressible (layer, KV head) pair, or
its tokens / ``compression_rate``; its own or the engine's default) is evicted down to it
after the step that computes the last token of its prompt, then (``compress_once`` off) every
``compression_interval`` decode steps, and whenever memory is short (``make_room``). The
planner decides from host state; the worker role (``kvcompress/runner.py``) scores, evicts on
the device and sends each evicted request's new per-head lengths back, which ``update``
applies to the per-head KV manager (``core/kv_cache/head_paged.py``, through the
``PerHeadKVManager`` protocol). Under tensor parallelism the manager tables every rank's KV
heads, so a budget counts them all, and the ranks' worker roles evict together as one rank
would (``kvcompress/shard.py``).

Evictions are asynchronous: under async scheduling a step is planned before the last step's
evictions come back. The evicted requests' lengths, blocks and held KVs on the host are then
the old ones, which bound the new ones (a head only loses KVs). That is safe: the blocks a
request held before an eviction (all of which it keeps until the lengths come back) hold every
KV the device keeps, the next step's slots come from the device's own lengths, and an eviction
planned meanwhile gets bounds (sort width, moves) at least the true ones. The one exception:
when evictions in flight free blocks the next step wants, the engine takes the last step's
results first (``wants_results_first``). Benchmark D (``benchmarks/README.md``) measures the
throughput these rules give.

Speculative decoding (host drafts: ngram, suffix). A step that verifies k drafts writes the KVs
of the request's last known token and its k drafts, the last 1 + k of every head; the
scheduler's update keeps the a accepted ones (``on_drafts_verified``). The rules:

- Rejected drafts' KVs go: the manager drops the last k - a KVs of every head at once
  (``drop_last``: the blocks past the new lengths go back) and the worker role drops them on
  the device before the next step (``KVCMetadata.trims``). Their slots were never scored.
- Scores: the verify row's queries of real tokens - the last known token's and the accepted
  drafts', a + 1 of them - add their squared probabilities to the keys they saw, as a + 1
  decode steps would (no max-pool); the rejected drafts' queries add nothing. The worker role
  keeps the row's queries from its forward pass and scores them before the next step, once
  the update has told it a (``KVCMetadata.verified``). So the scores are those KV-Compress
  alone would have given the same tokens.
- Evictions: none runs between a verify step's forward pass and its update (the KVs to drop
  must still be the last of every head): an eviction due after a verify step (the step
  counts as one decode step for ``compression_interval``) is planned at the update, from the
  lengths after the drop, and runs before the next step's forward pass, after the drop and
  the scores (``KVCMetadata.pre_evictions``): the same cache and scores as an eviction after
  the step would see, and the protected window is the last ``protected_window_size`` tokens
  the request really has. ``make_room`` never picks a request verifying drafts in the step.
  This needs each verify step's results before the next step is planned: the scheduler runs
  synchronous steps while such a step is in flight (``Scheduler.needs_sync``).

With continual compression the evictions then come after each verify step, not after each
token: the tokens are KV-Compress alone's evicting at those lengths, not at every one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagedllm.config import KVCompressConfig
from pagedllm.core.kv_cache.interface import PerHeadKVManager
from pagedllm.core.kv_cache.spec import cdiv
from pagedllm.core.request import Request
from pagedllm.core.sched.connector import ConnectorContext, KVConnectorScheduler


@dataclass(frozen=True)
class KVCEviction:
    """One request's eviction after a step. ``max_head_len`` and ``held`` are what the
    planner's manager knows after the step; they bound the device work without a host sync
    (the sort's width, and the number of KVs compaction may move)."""

    req_id: str
    budget: int  # KVs its compressible heads may keep
    protect_from: int  # positions >= this are never evicted
    max_head_len: int  # the longest head (any layer) after the step
    held: int  # KVs in its compressible heads after the step
    keep_below: int = 0  # positions < this are never evicted (its shared cached prefix)
    # tokens whose KVs exist once the step is done (the lengths that come back count them;
    # under async scheduling the next step's tokens are allocated before they come back)
    computed: int = 0
    # before the eviction: table entries (a HeadBlocks) that move to copies of the blocks
    # ``copy_src`` (cached prompt blocks that stay cached), or None
    copy_to: Any = None
    copy_src: Any = None


@dataclass
class KVCMetadata:
    """The step's KV-Compress plan for the worker role (plain data)."""

    # the requests to evict from after the step's forward pass (its attention scores count)
    evictions: list[KVCEviction] = field(default_factory=list)
    # requests new to the runner this step whose KVs are scored (they have a budget)
    scored: frozenset[str] = frozenset()
    # requests whose chunk this step scores keys with its last queries though it does not
    # sample (a chunk that ends where the request is evicted); empty by default
    window: frozenset[str] = frozenset()
    # speculative decoding (see the module docstring), before the step's forward pass, in this
    # order: request -> KVs to drop from the end of each head (its last step's rejected
    # drafts); request -> queries of its last step's verify row that score the keys (the
    # first a + 1: its last known token's and its accepted drafts'); the evictions due after
    # its last step
    trims: dict[str, int] = field(default_factory=dict)
    verified: dict[str, int] = field(default_factory=dict)
    pre_evictions: list[KVCEviction] = field(default_factory=list)


@dataclass
class KVCReport:
    """The worker role's report of a step (plain data): each evicted request's computed KVs
    left per (layer, KV head) [LH], after the evictions that ran after the step's forward
    pass (``lens``) and before it (``pre``)."""

    lens: dict[str, np.ndarray] = field(default_factory=dict)
    pre: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class _Track:
    """A request's KV-Compress state: its budget rule (``KVCompressConfig.budget_of``), the
    tokens when last compressed (-1: not since its KVs were (re)computed) and decode steps
    since."""

    rule: tuple[int | None, float | None]
    compressed_at: int = -1
    steps: int = 0


class KVCompressPlanner(KVConnectorScheduler):
    """Plans KV-Compress evictions (see the module docstring)."""

    name = "kvcompress"

    def __init__(self, context: ConnectorContext, config: KVCompressConfig) -> None:
        super().__init__(context)
        kvm = context.kv_manager
        if not isinstance(kvm, PerHeadKVManager):
            raise ValueError("KV-Compress needs the model runner's per-head KV-cache groups.")
        self.kvm: PerHeadKVManager = kvm
        self.config = config
        self.block_size = kvm.block_size
        self.num_heads = int(kvm.compressible.sum())  # the (layer, KV head) pairs a budget counts
        self.tracks: dict[str, _Track] = {}
        # requests with a budget: without any, a step plans no eviction unless memory is short
        self.budgeted: set[str] = set()
        # request -> [its evictions whose lengths have not come back, the blocks they free at
        # least] (``_frees``)
        self.inflight: dict[str, list[int]] = {}
        # the free blocks the next schedule() wants at its start (``wants_results_first``)
        self.wanted = 0
        self._free_start = 0
        self._room: dict[str, int] = {}  # requests to evict from for room -> their budgets
        # speculative decoding (the module docstring): requests whose eviction is due once
        # their step's drafts are verified; and, for the next step's metadata, the KVs each
        # request drops, the queries of its verify row that score, its eviction before it
        self._due_verified: set[str] = set()
        self._trims: dict[str, int] = {}
        self._verified: dict[str, int] = {}
        self._pre: dict[str, KVCEviction] = {}
        self._short = False  # memory is short and this step's evictions make room
        # whether a subclass scores chunks that do not sample (asked per request only then)
        self._windows = type(self).window_scored is not KVCompressPlanner.window_scored

    # ------------------------------------------------------------------ requests
    def add_request(self, request: Request) -> None:
        rule = self.config.budget_of(request.sampling_params)
        if _hands_over(request):
            # a prefill engine's request (prefill/decode disaggregation): its prompt's KVs
            # leave whole, as rows of every head written while the prompt runs, and the
            # decode engine compresses them with its own budget (an eviction here would
            # compact the blocks under the rows being gathered)
            rule = (None, None)
        self.tracks[request.request_id] = _Track(rule)
        if rule != (None, None):
            self.budgeted.add(request.request_id)

    def budget(self, request: Request, num_tokens: int) -> int | None:
        """KVs the request's compressible heads may keep at ``num_tokens`` tokens: its
        ``max_cache_tokens`` x compressible (layer, KV head) pairs, or ``num_tokens`` x pairs /
        ``compression_rate`` (rounded up); None when it has neither (never compressed)."""
        m, rate = self.tracks[request.request_id].rule
        if m is not None:
            return m * self.num_heads
        if rate is not None:
            return math.ceil(num_tokens * self.num_heads / rate)
        return None

    def on_preempt(self, request: Request, swapped: bool) -> None:
        rid = request.request_id
        if not swapped:  # its KVs are computed again, uncompressed
            self.tracks[rid].compressed_at = -1
            self.inflight.pop(rid, None)
        # the runner drops its row: nothing to trim, score or evict there (its rejected
        # drafts' KVs left the manager at the update; a swapped request has no eviction in
        # flight, ``may_swap``, and its last verify row's queries never score)
        self._forget_spec(rid)

    def _forget_spec(self, rid: str) -> None:
        self._due_verified.discard(rid)
        self._trims.pop(rid, None)
        self._verified.pop(rid, None)
        self._pre.pop(rid, None)

    def may_swap(self, request: Request) -> bool:
        """A request whose eviction is still on the device is recomputed: its blocks on the
        host would be the ones from before the eviction."""
        return request.request_id not in self.inflight

    def on_free(self, request: Request) -> None:
        rid = request.request_id
        self.tracks.pop(rid, None)
        self.budgeted.discard(rid)
        self.inflight.pop(rid, None)
        self._forget_spec(rid)

    def reset(self) -> None:
        self.inflight.clear()
        for d in (self._trims, self._verified, self._pre):
            d.clear()
        self._due_verified.clear()

    def on_drafts_verified(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """A step verified ``num_drafts`` drafts of the request and kept ``num_accepted``
        (its computed tokens already went back by the others). The rejected drafts' KVs leave
        the manager now and the device before the next step; the verify row's queries of real
        tokens score before it; an eviction that was due after the step is planned now, from
        the lengths without the rejected drafts, to run before the next step's forward pass
        (the module docstring).

        Example: 40 computed, 1 + 4 scheduled (45), 1 accepted -> 42 computed: every head
        drops 3 KVs, 2 queries score, and an eviction due protects positions >= 42 - window."""
        rid = request.request_id
        rejected = num_drafts - num_accepted
        if rejected > 0:
            self.kvm.drop_last(request, rejected)
            self._trims[rid] = self._trims.get(rid, 0) + rejected
        if rid in self.budgeted:
            self._verified[rid] = num_accepted + 1
        if rid in self._due_verified:
            self._due_verified.discard(rid)
            track, computed = self.tracks[rid], request.num_computed_tokens
            track.compressed_at = min(track.compressed_at, computed)  # (not its drafts)
            budget = self._over(request, computed)
            if budget is not None:
                plan = self._plan({rid: budget}, {})
                if plan:
                    self._pre[rid] = plan[0]

    # --------------------------------------------------------------------- steps
    def begin_step(self) -> None:
        self.wanted = 0
        self._free_start = self.kvm.num_free_blocks()
        self._room = {}
        self._short = False

    def make_room(
        self, request: Request, num_new: int, num_scheduled: Mapping[str, int], preempted: bool
    ) -> bool:
        """Evict from running requests over their budget rather than preempt: this request
        waits for the blocks that frees (next step); the others that need no new block run."""
        if self._short:
            return True  # waits for the blocks this step's evictions free
        if preempted:
            return False
        short = self.kvm.blocks_short(request, num_new)
        # (the blocks this step has taken so far count: the next step takes them again
        # before it reaches this request)
        self.wanted = self._free_start + short
        self._short = self._mark_for_room(num_scheduled, short)
        return self._short

    def admission_blocked(self, request: Request, num_new: int) -> None:
        self.wanted = self._free_start + self.kvm.blocks_short(request, num_new)

    def _over(self, request: Request, num_tokens: int) -> int | None:
        """The budget when the request holds more KVs than it (else None). A protected
        cached prefix counts in neither (``settle_prefix``)."""
        rid = request.request_id
        budget = self.budget(request, num_tokens - self.kvm.prefix_tokens(rid))
        if budget is None or self.kvm.held_kvs(rid) <= budget:
            return None
        return budget

    def _mark_for_room(self, num_scheduled: Mapping[str, int], short: int) -> bool:
        """Memory is short by ``short`` blocks: mark running requests over their budget that
        grew since their last eviction for eviction after this step - those grown by at least
        a block's tokens (every one of them, most grown first), and the others only when those
        cannot free ``short`` blocks. False, marking none, when even evicting all of them down
        to their budgets could not free ``short`` blocks (then the scheduler preempts:
        evicting a few KVs each step for a request that still would not fit only stalls it).

        Why a block's growth: each eviction costs host and device work per request, and a
        request grown by g tokens frees about g / bs blocks a head; evicting every request
        grown by a token or two, step after step, costs more host time than the blocks it
        frees are worth. A request whose eviction is still on the device is skipped (its
        lengths on the host are the old ones until it comes back), but what that eviction
        frees counts: True, marking none, when evictions in flight free ``short`` blocks (the
        request waits a step for them rather than preempt another, whose prompt would run
        again).

        Freed blocks, at least: a request ``e`` KVs over its budget frees ``ceil(e / bs)``
        blocks (``_frees``).
        Example: bs 16, growth 40, 3 and 20 tokens -> the first and third are marked; the
        second too only if those two free fewer than ``short`` blocks."""
        bs, room, ctx = self.block_size, self._room, self.context
        grown: list[tuple[int, Request, int]] = []  # (growth, request, tokens after the step)
        for r in ctx.running:
            rid = r.request_id
            if rid in room or rid not in ctx.runner_has or rid in self.inflight:
                continue
            after = r.num_computed_tokens + num_scheduled.get(rid, 0)
            if after > r.num_tokens + r.num_output_placeholders:
                continue  # it verifies drafts: no eviction before their update
            at = self.tracks[rid].compressed_at
            if after > at:  # (an eviction at its length freed what it could)
                grown.append((after - at, r, after))
        grown.sort(key=lambda g: -g[0])
        chosen: dict[str, int] = {}
        freeable = sum(blocks for _, blocks in self.inflight.values())
        for growth, r, after in grown:
            if growth < bs and freeable >= short:
                break
            budget = self._over(r, after)
            if budget is not None:
                chosen[r.request_id] = budget
                freeable += self._frees(self.kvm.held_kvs(r.request_id), budget)
        if freeable < short or not (chosen or self.inflight):
            return False
        room.update(chosen)
        return True

    def _frees(self, held: int, budget: int) -> int:
        """Blocks an eviction of a request holding ``held`` KVs down to ``budget`` frees, at
        least: each evicted chunk frees one block and holds at most bs KVs.
        Example: bs 16, 1,000 KVs over -> 63 blocks."""
        return cdiv(max(held - budget, 0), self.block_size)

    def eviction_due(self, request: Request, after: int) -> bool:
        """Whether a scheduled request is evicted after this step (it holds ``after`` tokens
        then): the step computes its prompt's last KVs (it samples for the first time since
        they were computed), or it is due for continual compression (``compress_once`` off:
        every ``compression_interval`` decode steps; a step verifying drafts counts as one).
        Records the request's progress (its first compression point, its decode steps since)
        as it answers."""
        if after < request.num_tokens + request.num_output_placeholders:
            return False  # a prefill chunk short of the prompt's end
        track = self.tracks[request.request_id]
        if track.compressed_at < 0:  # its prompt's KVs are all computed this step
            track.compressed_at = after
            return True
        p = request.sampling_params
        once = self.config.compress_once if p.compress_once is None else p.compress_once
        track.steps += 1
        return not once and track.steps >= self.config.compression_interval

    def window_scored(self, request: Request, after: int) -> bool:
        """Whether the request's chunk scores keys with its last queries though it does not
        sample (none by default: a prompt's last chunk samples and scores)."""
        return False

    def build_metadata(
        self, num_scheduled: Mapping[str, int], new_req_ids: Sequence[str]
    ) -> KVCMetadata | None:
        """The evictions after this step (``eviction_due``, and those ``make_room`` chose;
        each only when the request holds more KVs than its budget) and which new requests
        are scored."""
        requests = self.context.requests
        scored = frozenset(r for r in new_req_ids if r in self.budgeted)
        spec = self._take_spec()
        if not self._room and not self.budgeted:
            if not new_req_ids and not spec:
                return None
            return KVCMetadata(scored=scored, **spec)
        chosen = dict(self._room)
        window = []
        for rid, n in num_scheduled.items():
            if rid in chosen or rid not in self.budgeted:
                continue  # no budget: never evicted (e.g. KV-Compress on, a plain request)
            r = requests[rid]
            after = r.num_computed_tokens + n
            if self._windows and self.window_scored(r, after):
                window.append(rid)
            if self.eviction_due(r, after):
                if after > r.num_tokens + r.num_output_placeholders:
                    self._due_verified.add(rid)  # it verifies drafts: planned at the update
                    continue
                budget = self._over(r, after)
                if budget is not None:
                    chosen[rid] = budget
        plan = self._plan(chosen, num_scheduled)
        return KVCMetadata(plan, scored, frozenset(window), **spec)

    def _take_spec(self) -> dict[str, Any]:
        """The speculative-decoding work since the last step (``KVCMetadata``'s fields);
        empty when there is none."""
        if not (self._trims or self._verified or self._pre):
            return {}
        out = {
            "trims": self._trims,
            "verified": self._verified,
            "pre_evictions": list(self._pre.values()),
        }
        self._trims, self._verified, self._pre = {}, {}, {}
        return out

    def _plan(self, chosen: dict[str, int], num_scheduled: Mapping[str, int]) -> list[KVCEviction]:
        """An eviction for each chosen request still over its budget once its shared cached
        prefix is settled (the budget counts the KVs after it; the device counts all)."""
        kvm, plan = self.kvm, []
        for rid in chosen:
            r = self.context.requests[rid]
            after = r.num_computed_tokens + num_scheduled.get(rid, 0)
            track = self.tracks[rid]
            track.compressed_at, track.steps = after, 0
            # the blocks it shares through the prefix cache are protected from now on
            prefix = kvm.settle_prefix(r)
            budget = self._over(r, after)
            if budget is None:
                continue
            # its own cached prompt blocks: copied first where there is room (the cache
            # keeps them for later requests), else out of the cache
            copy_to, copy_src = kvm.detach_own(r, keep_cached=True) or (None, None)
            max_len, held = kvm.head_extent(rid)
            shared = prefix * self.num_heads
            p = r.sampling_params.protected_window_size
            protect = after - (self.config.protected_window_size if p is None else p)
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
            entry = self.inflight.setdefault(rid, [0, 0])
            entry[0] += 1
            entry[1] += self._frees(held + shared, budget + shared)
        return plan

    def end_step(self, num_scheduled: Mapping[str, int], prompt_tokens: bool) -> None:
        """``wanted`` at least the blocks of the next step's prompt tokens: those left of the
        prompts this step cut, then the first waiting request's (while a seat is free), up to
        the token budget.
        Example: budget 8,192, 2,000 tokens left of a prompt and a 6,000-token one waiting
        -> the blocks of 8,000 tokens (``blocks_for_tokens``)."""
        ctx = self.context
        tokens = 0
        if prompt_tokens:
            for rid, n in num_scheduled.items():
                r = ctx.requests[rid]
                if n > 1 and r.num_computed_tokens < r.num_tokens:
                    tokens += r.num_tokens - r.num_computed_tokens
        if ctx.waiting and len(ctx.running) < ctx.scheduler_config.max_num_seqs:
            first = ctx.waiting.peek()
            tokens += first.num_tokens - first.num_computed_tokens
        tokens = min(tokens, ctx.scheduler_config.max_num_batched_tokens)
        if tokens:
            self.wanted = max(self.wanted, self.kvm.blocks_for_tokens(tokens))

    def update(self, metadata: KVCMetadata | None, output: KVCReport | None) -> None:
        """Apply the new per-head lengths of the step's evictions (a request preempted or
        finished since has forgotten its eviction)."""
        if metadata is None or not (metadata.evictions or metadata.pre_evictions):
            return
        assert isinstance(output, KVCReport)
        inflight = self.inflight
        # (those before the forward pass first: a request may have one of each)
        for evictions, lens in ((metadata.pre_evictions, output.pre),
                                (metadata.evictions, output.lens)):  # fmt: skip
            for e in evictions:
                entry = inflight.get(e.req_id)
                if entry is None:
                    continue
                entry[0] -= 1
                entry[1] -= self._frees(e.held, e.budget)
                if not entry[0]:
                    del inflight[e.req_id]
                request = self.context.requests[e.req_id]
                self.kvm.apply_compaction(request, lens[e.req_id], e.computed)

    # ------------------------------------------------------------- engine-level asks
    def wants_results_first(self) -> bool:
        """True when evictions are in flight and the pool has fewer blocks free than the next
        step wants: what the last ``schedule()`` was short of when memory stopped it, or else
        the blocks of the prompt tokens it left for the next step (``end_step``). Those
        evictions free blocks the next step would otherwise go without: the blocks an
        eviction frees reach the host a step late, and without this each long prompt's
        admission waited a step for the eviction of the prompt before it. Waiting idles the
        device for the host's update, schedule and launch of one step.

        Example (bs 16, 2 heads, a token budget of 6,000): the last schedule computed a
        6,000-token prompt whole, a second one waiting -> it wants 375 x 2 blocks; 600 are
        free now and the first prompt's eviction is in flight -> True."""
        if not self.inflight or not self.wanted:
            return False
        return self.kvm.num_free_blocks() < self.wanted

    def stats(self) -> dict[str, float]:
        return {
            "kvc_compressions": self.kvm.num_compressions,
            "kvc_evicted_kvs": self.kvm.num_evicted_kvs,
        }


def _hands_over(request: Request) -> bool:
    """Whether the request asks to hand its prompt's KV to a decode engine
    (``kv_transfer_params.do_remote_decode``, ``core/kv_transfer/scheduler.py``)."""
    extra = getattr(request.sampling_params, "extra_args", None)
    params = extra.get("kv_transfer_params") if isinstance(extra, dict) else None
    return isinstance(params, dict) and bool(params.get("do_remote_decode"))
