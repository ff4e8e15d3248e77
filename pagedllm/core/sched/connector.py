"""The KV seam, scheduler side: one object per feature that changes a KV cache's life.

A feature that evicts, moves or copies KV outside the plain allocate / free path has two roles,
named by one entry of ``KV_CONNECTORS``:

- a **scheduler role** (a ``KVConnectorScheduler``, here, pure Python): it plans from host
  state - what to evict, load or send - and answers "may this request run now?";
- a **worker role** (a ``KVConnectorWorker``, ``pagedllm/worker/kv_connector.py``): it moves
  bytes on the device and reports what landed.

Each step the scheduler role builds one plain-data metadata object (``build_metadata``); it
travels in ``SchedulerOutput.kv_connector_metadata[name]`` to the worker role, whose report
comes back in ``ModelRunnerOutput.kv_connector_output[name]`` to ``update_from_output``. The
scheduler and the model runner call the roles at the hooks below and know nothing else of the
feature. KV-Compress is the first user (``core/sched/kvc.py`` and ``kvcompress/runner.py``).

How the other users plug in:

- **The host KV tier** (``offload``: ``core/sched/offload.py``, ``worker/offload.py``). A hit
  in the tier extends the device prefix hit at admission, so the scheduler asks the roles
  there (``external_hit``: the tokens a role can bring; ``external_alloc``: the device blocks
  allocated for them, to fill this step) and counts those tokens computed - skipping them
  through ``num_new_tokens`` would leave them without blocks. ``build_metadata`` lists the
  step's loads and the saves of the full blocks its requests hold; the worker role loads
  before the forward pass and saves after it (a side stream on a GPU), ``finish`` when the
  copies are done.
- **Prefill/decode disaggregation** (``kv_transfer``: ``core/kv_transfer/``,
  ``worker/kv_transfer.py``). On a producer, ``build_metadata`` lists the full prompt blocks
  each step completes (written through, as the host tier's saves: a window group's blocks are
  written while the window holds them), the worker role writes them into the request's
  transfer file after the forward pass and publishes it in ``finish``, before the step's
  results leave the engine; the blocks are freed as usual. On a consumer, ``add_request``
  claims and checks the transfer (a bad one refuses the request alone), and
  ``external_hit`` / ``external_alloc`` bring its blocks after the device's and the host
  tier's hits, as the tier does: each role's hit starts where the ones before it end.

Rules every role keeps: a hook is cheap when the feature has nothing to do (the hot path of a
decode step calls ``num_new_tokens`` only for roles that override it); the metadata is plain
data (it pickles to worker processes); a role never changes ``Request`` fields the scheduler
owns except through the values its hooks return.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from pagedllm.core.request import Request

# name -> ("module:SchedulerRoleClass", "module:WorkerRoleClass"). The roles are imported only
# when an engine uses them (lazy factory: the scheduler's floor never imports a worker's).
KV_CONNECTORS: dict[str, tuple[str, str]] = {
    "kvcompress": (
        "pagedllm.core.sched.kvc:KVCompressPlanner",
        "pagedllm.kvcompress.runner:KVCompressWorker",
    ),
    "offload": (
        "pagedllm.core.sched.offload:OffloadScheduler",
        "pagedllm.worker.offload:OffloadWorker",
    ),
    "kv_transfer": (
        "pagedllm.core.kv_transfer.scheduler:KVTransferScheduler",
        "pagedllm.worker.kv_transfer:KVTransferWorker",
    ),
}


def register_kv_connector(name: str, scheduler_role: str, worker_role: str) -> None:
    """Make ``name`` usable in ``kv_connectors`` (engine argument): each role as
    ``"module:Class"``. Registering an existing name replaces its roles (a benchmark may swap
    in a probe that subclasses a role). Worker processes (tensor parallelism) import the
    roles by these paths but see only the registrations of the modules they import: register
    a connector at the import of a module every process imports, or run in-process."""
    for path in (scheduler_role, worker_role):
        if ":" not in path:
            raise ValueError(f"a KV connector role is 'module:Class', got {path!r}.")
    KV_CONNECTORS[name] = (scheduler_role, worker_role)


@contextmanager
def scheduler_role_swapped(name: str, scheduler_role: str) -> Iterator[None]:
    """Inside the block, connector ``name``'s scheduler role is ``scheduler_role``
    (``"module:Class"``, e.g. a subclass that probes or replays its decisions); its worker role
    stays. Engines built inside the block keep the swapped role."""
    saved = KV_CONNECTORS[name]
    register_kv_connector(name, scheduler_role, saved[1])
    try:
        yield
    finally:
        KV_CONNECTORS[name] = saved


def load_role(name: str, worker: bool) -> type:
    """The class of connector ``name``'s scheduler role (or worker role). Lazy factory: the
    module is imported here, on first use."""
    if name not in KV_CONNECTORS:
        raise ValueError(f"unknown KV connector {name!r}; known: {sorted(KV_CONNECTORS)}.")
    module, _, cls = KV_CONNECTORS[name][int(worker)].partition(":")
    return getattr(importlib.import_module(module), cls)


class KVConnectorScheduler:
    """The scheduler role of a KV connector. Every hook is a no-op here: a role overrides the
    ones its feature needs. ``kv_manager`` is the scheduler's KV manager (a role that needs
    more than the base protocol checks for its own protocol in ``__init__``)."""

    name = "base"

    def __init__(self, context: ConnectorContext) -> None:
        self.context = context

    # ------------------------------------------------------------------ requests
    def add_request(self, request: Request) -> None:
        """A request (or a fork / beam of one) enters the scheduler. Raise ValueError for a
        request this feature can never serve."""

    @property
    def cuts_tokens(self) -> bool:
        """Whether this role overrides ``num_new_tokens`` (the scheduler asks only those)."""
        return type(self).num_new_tokens is not KVConnectorScheduler.num_new_tokens

    def num_new_tokens(self, request: Request, num_new: int) -> int:
        """The tokens the request may compute this step, at most ``num_new`` (e.g. a chunk
        that must end where KV is evicted, or 0 while its KV is still loading)."""
        return num_new

    def external_hit(self, request: Request, num_device_hit: int) -> int:
        """Tokens after the first ``num_device_hit`` (the device prefix hit and the hits of
        the roles before this one) whose KV this role can bring instead of computing them (a
        multiple of the block size; 0: none)."""
        return 0

    def external_alloc(self, request: Request, num_device_hit: int, num_tokens: int) -> None:
        """The scheduler admitted the request with device blocks for the ``num_tokens`` tokens
        this role's ``external_hit`` offered after the first ``num_device_hit`` and counts them
        computed: plan filling them this step (called only when ``num_tokens`` > 0)."""

    def on_preempt(self, request: Request, swapped: bool) -> None:
        """The request was preempted (its blocks swapped out, or freed for recompute)."""

    def may_swap(self, request: Request) -> bool:
        """Whether the request's blocks may be swapped out now (False: recompute it)."""
        return True

    def on_free(self, request: Request) -> None:
        """The request ended (finished, aborted, or dropped from a beam)."""

    def on_cache_invalid(self, keys: Sequence[Any]) -> None:
        """These prefix-cache keys' device blocks held wrong contents (a KV load into them
        failed): forget anything made from them (a host tier's copies)."""

    def on_drafts_verified(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """A step verified ``num_drafts`` draft tokens of the request (speculative decoding)
        and kept the first ``num_accepted``: its ``num_computed_tokens`` already went back by
        the others, whose KVs the step wrote after its known tokens' (garbage now). Called
        from the update, before the request's new tokens are appended."""

    def reset(self) -> None:
        """A step failed: forget every plan in flight (the scheduler ends the requests)."""

    # --------------------------------------------------------------------- steps
    def begin_step(self) -> None:
        """``schedule()`` starts."""

    def make_room(
        self, request: Request, num_new: int, num_scheduled: Mapping[str, int], preempted: bool
    ) -> bool:
        """A running request's ``num_new`` tokens found no blocks. True: the role frees room
        with this step's plan (the request waits a step, no request is admitted this step);
        False: the scheduler preempts as usual. ``preempted``: the step has preempted."""
        return False

    def admission_blocked(self, request: Request, num_new: int) -> None:
        """A waiting request's first chunk (``num_new`` tokens) found no blocks."""

    def build_metadata(
        self, num_scheduled: Mapping[str, int], new_req_ids: Sequence[str]
    ) -> Any | None:
        """The step's plan for the worker role (plain data), or None when there is none.
        Called once a step, after every request is scheduled and before their progress
        advances (``num_computed_tokens`` is still the step's start)."""
        return None

    def end_step(self, num_scheduled: Mapping[str, int], prompt_tokens: bool) -> None:
        """After the step's progress advanced. ``prompt_tokens``: some row computes more than
        one token (a prompt chunk or drafts)."""

    def update(self, metadata: Any | None, output: Any | None) -> None:
        """A step's results came back: its ``metadata`` and the worker role's ``output``."""

    # ------------------------------------------------------------- engine-level asks
    def wants_results_first(self) -> bool:
        """Under async scheduling: whether the next step should wait for the last step's
        results before it is scheduled (the engine core then takes them first)."""
        return False

    def stats(self) -> dict[str, float]:
        """Counters for the engine's metrics."""
        return {}


def block_tables(kv: Any, flag: str) -> list[Any]:
    """The managers whose block tables a role that copies whole blocks works on: the plain
    manager, or each group's of the hybrid one; ValueError naming ``flag`` for KV-Compress's
    per-head blocks."""
    from pagedllm.core.kv_cache.hybrid import HybridKVCacheManager
    from pagedllm.core.kv_cache.manager import KVCacheManager

    if type(kv) is KVCacheManager:
        return [kv]
    if type(kv) is HybridKVCacheManager:
        return list(kv.groups)
    raise ValueError(f"{flag} does not work with KV-Compress's per-head blocks yet.")


def cap_to_free(kv: Any, num_tables: int, budget: int, request: Request, hit: int, n: int) -> int:
    """At most ``n`` external blocks after ``hit`` tokens such that they and the request's
    first chunk fit the free blocks of every table (the loaded blocks are allocated at once,
    in every table: else a window group's whole prompt could outgrow a pool sized for its
    window, and the request wait forever).

    Example: 29 free, 2 tables (14 each), a budget of 32, 300 tokens after the hit, 13
    blocks offered -> 13 + 2 > 14: 12 blocks, and a chunk of 32 (the hit's own blocks may be
    among the free ones, cached: not for these)."""
    bs = kv.block_size
    avail = (kv.num_free_blocks() - hit // bs * num_tables) // num_tables
    left = request.num_tokens - hit
    while n and n + -(-min(budget, left - n * bs) // bs) > avail:
        n -= 1
    return n


def cap_external(
    kv: Any, heads: Any, num_tables: int, budget: int, request: Request, hit: int, n: int
) -> int:
    """``cap_to_free`` for any KV manager: ``heads``, KV-Compress's per-head manager where
    ``kv`` is one (a ``PerHeadRows``, resolved once by the role; else None), needs a block of
    every (layer, KV head) per external block, and the first chunk's after them
    (``fits_first``)."""
    if heads is None:
        return cap_to_free(kv, num_tables, budget, request, hit, n)
    bs, left = heads.block_size, request.num_tokens - hit
    while n and not heads.fits_first(request, n * bs + min(budget, left - n * bs)):
        n -= 1
    return n


@dataclass(frozen=True)
class ConnectorContext:
    """What a scheduler role may read of the scheduler: its KV manager, its live requests
    (id -> Request), the running and waiting queues, the ids the runner holds state for, and
    the config. The containers are the scheduler's own (live views, not copies). ``fail``
    ends requests with an error (id -> why) after telling every role which prefix-cache keys
    held wrong contents (``on_cache_invalid``)."""

    kv_manager: Any
    requests: dict[str, Request]
    running: Any
    waiting: Any
    runner_has: set[str]
    scheduler_config: Any
    fail: Callable[[Mapping[str, str], Sequence[Any]], None] | None = None


def make_scheduler_roles(
    names: Sequence[str], context: ConnectorContext, configs: Mapping[str, Any]
) -> list[KVConnectorScheduler]:
    """The scheduler roles of the engine's connectors, in order; ``configs[name]`` is a role's
    own config when it has one (KV-Compress: its ``KVCompressConfig``)."""
    roles = []
    for name in names:
        cls = load_role(name, worker=False)
        roles.append(cls(context, configs.get(name)) if name in configs else cls(context))
    return roles
