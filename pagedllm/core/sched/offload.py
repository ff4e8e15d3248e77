"""The host KV tier (``kv_offloading_size``), scheduler role: prefix blocks kept in host memory
after the device pool reuses them, found by the same block hashes, loaded back on a hit.

A KV connector (``core/sched/connector.py``) named ``offload``; its worker role is
``pagedllm/worker/offload.py``.

- **Saves (write-through).** Each step, the full blocks of the scheduled requests that this
  step completes (or that earlier steps did and no save took yet) and whose hash the tier lacks
  get a host block; ``build_metadata`` lists (device block, host block) pairs, which the worker
  role copies after the forward pass. An entry is *landing* until that step's results come
  back: no load reads it and no eviction takes it before then.
- **Loads.** At admission the scheduler asks ``external_hit``: the tokens of the full blocks
  after the device prefix hit that the tier holds, consecutively. The scheduler allocates
  device blocks for them with the prompt's first chunk and counts them computed; then
  ``external_alloc`` plans the (host block, device block) copies, which the worker role makes
  before the step's forward pass (the same stream: the forward reads them after).
- **Room.** An LRU over the entries neither landing nor being loaded, a request's blocks
  touched last block first so that its head blocks go last (a chain is only reachable from
  its head); a save that finds no free or evictable host block is skipped (the block stays
  recomputable).

Example (block size 4, a 10-token prompt, its first block cached on the device, blocks 1 and 2
in the tier as host blocks 7 and 3): the device hit is 4 tokens, ``external_hit`` gives 4 more
(block 2 would leave no token to compute: at most (10 - 1) // 4 = 2 blocks are hits), the
request computes tokens 8..9 and the step first copies host block 7 into its second device
block.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagedllm.core.kv_cache.interface import PerHeadRows
from pagedllm.core.kv_transfer.files import row_bytes
from pagedllm.core.request import Request
from pagedllm.core.sched.connector import (
    ConnectorContext,
    KVConnectorScheduler,
    block_tables,
    cap_external,
)


@dataclass(frozen=True)
class OffloadConfig:
    """The host tier's size in blocks (``kv_offloading_size`` bytes over a block's bytes in
    every layer's K and V); ``keep_last``: prompt tokens a hit always leaves to compute
    (KV-Compress: its observation window, as ``KVTransferRoleConfig.keep_last``)."""

    num_host_blocks: int
    block_bytes: int = 0  # of one block id in every layer's K and V (the metrics' bytes)
    keep_last: int = 1

    def __post_init__(self) -> None:
        if self.num_host_blocks < 1:
            raise ValueError(
                "kv_offloading_size is smaller than one KV block of this model "
                f"({self.num_host_blocks} host blocks); raise it or leave it unset."
            )


def offload_config(cache_config: Any, kv_groups: Any, keep_last: int = 1) -> OffloadConfig | None:
    """The tier's config from ``kv_offloading_bytes`` (None when it is 0 or the KV groups are
    unknown; ``keep_last``: ``roles.keep_last``). KV-Compress: a host block is a row of one
    block of every (layer, KV head)."""
    nbytes = cache_config.kv_offloading_bytes
    if not nbytes or kv_groups is None:
        return None
    block = row_bytes(kv_groups)
    return OffloadConfig(nbytes // block, block, keep_last)


@dataclass
class OffloadMetadata:
    """One step's copies: loads (host block, device block) before the forward pass, saves
    (device block, host block) after it. KV-Compress: a load is (host block, its block index
    in the prompt) and a save (block index, host block), with ``load_heads`` /
    ``save_heads`` [n, LH] (aligned with them) the block of each (layer, KV head)."""

    loads: list[tuple[int, int]] = field(default_factory=list)
    saves: list[tuple[int, int]] = field(default_factory=list)
    load_heads: list[np.ndarray] = field(default_factory=list)
    save_heads: list[np.ndarray] = field(default_factory=list)


@dataclass
class OffloadReport:
    """The host time one step's copies took (what they copied, the metadata says)."""

    host_s: float = 0.0


class OffloadScheduler(KVConnectorScheduler):
    """Host-tier bookkeeping: which hashes the host blocks hold, LRU order, what is in flight
    (see the module docstring)."""

    name = "offload"

    def __init__(self, context: ConnectorContext, config: OffloadConfig | None) -> None:
        super().__init__(context)
        if config is None:
            raise ValueError("the 'offload' KV connector needs kv_offloading_size (GiB).")
        kv = context.kv_manager
        # KV-Compress's per-head manager: a host block is block i of every (layer, KV head)
        self.heads: PerHeadRows | None = kv if isinstance(kv, PerHeadRows) else None
        self.tables: list[Any] = (
            [kv] if self.heads is not None else block_tables(kv, "kv_offloading_size")
        )
        if not kv.enable_caching:
            raise ValueError("kv_offloading_size needs enable_prefix_caching=True.")
        self.kv = kv
        self.keep_last = config.keep_last
        null = None if self.heads is not None else kv.block_pool.null_block
        self.null_id = -1 if null is None else null.block_id
        self.block_size = kv.block_size
        self.budget = context.scheduler_config.max_num_batched_tokens
        self.num_host_blocks = config.num_host_blocks
        self.block_bytes = config.block_bytes
        self.free: list[int] = list(range(config.num_host_blocks - 1, -1, -1))
        # key -> host block, least recently used first (landing entries included); a key is
        # a table's prefix-cache key: the block hash, (group, hash) for the hybrid's groups > 0
        self.entries: OrderedDict = OrderedDict()
        self.busy: dict[int, int] = {}  # host block -> copies in flight (landing or loading)
        self.orphans: set[int] = set()  # busy host blocks whose entry was forgotten
        # host block -> the key its save (not back yet) brings; a key is landing when its
        # entry's host block is here (a busy block is never handed to another key)
        self.landing: dict = {}
        self.saved_upto: dict[str, int] = {}  # request -> its blocks before this considered
        self.asked: dict[str, int] = {}  # request -> tokens its last admission looked up
        self.planned: OffloadMetadata = OffloadMetadata()
        # counters (tokens and blocks)
        self.hit_tokens = 0
        self.queried_tokens = 0
        self.loaded_blocks = 0
        self.saved_blocks = 0
        self.skipped_saves = 0
        self.host_s = 0.0

    def _hashes(self, request: Request) -> list:
        """The request's full blocks' hashes."""
        if self.heads is not None:
            return self.heads.block_hashes(request)
        return self.tables[0]._block_hashes(request)

    def _keys(self, h: Any) -> list:
        """Every table's key of block hash ``h`` (KV-Compress: one, the hash itself)."""
        return [h] if self.heads is not None else [m._key(h) for m in self.tables]

    # ------------------------------------------------------------------ admission
    def external_hit(self, request: Request, num_device_hit: int) -> int:
        """Tokens after the device hit (``num_device_hit``, block-aligned) that the tier holds:
        whole blocks, consecutive, at most up to the last full block before the prompt's last
        token (that token is always computed, for its logits)."""
        if not self.kv.uses_prefix_cache(request):
            return 0
        bs = self.block_size
        first, last = num_device_hit // bs, (request.num_tokens - self.keep_last) // bs
        # counted once the request is admitted (build_metadata): a request that waits asks
        # again each step
        self.asked[request.request_id] = max(last - first, 0) * bs
        n = 0
        if self.entries:
            # every table's block (a window group's too: loaded whole, the runner's next
            # step drops what left the window)
            entries, landing = self.entries, self.landing
            for h in self._hashes(request)[first : max(first, last)]:
                if any(k not in entries or entries[k] in landing for k in self._keys(h)):
                    break
                n += 1
        if n:  # (the loaded blocks are allocated at once, in every table: cap_external)
            n = cap_external(
                self.kv, self.heads, len(self.tables), self.budget, request, num_device_hit, n
            )
        return n * bs

    def external_alloc(self, request: Request, num_device_hit: int, num_tokens: int) -> None:
        """The scheduler allocated device blocks for ``num_tokens`` tokens from the tier after
        the device hit: plan their loads (this step, before the forward pass)."""
        bs = self.block_size
        first = num_device_hit // bs
        hashes = self._hashes(request)[first : first + num_tokens // bs]
        if self.heads is not None:  # (loaded, not computed: the runner's table counts them)
            columns = self.heads.block_columns(request.request_id, first, len(hashes))
            self.heads.count_loaded(request.request_id, num_tokens)
            for i in reversed(range(len(hashes))):  # (head last: build_metadata)
                host = self._touch(hashes[i])
                self.planned.loads.append((host, first + i))
                self.planned.load_heads.append(columns[i])
        for m in self.tables if self.heads is None else ():
            device = m.get_block_ids(request.request_id)[first : first + len(hashes)]
            for h, d in reversed(list(zip(hashes, device))):  # (head last: build_metadata)
                self.planned.loads.append((self._touch(m._key(h)), d))
        self.hit_tokens += num_tokens
        self.loaded_blocks += len(hashes) * len(self.tables)

    def _touch(self, key: Any) -> int:
        """The host block of entry ``key``, made most recently used and busy (a load)."""
        host = self.entries[key]
        self.entries.move_to_end(key)
        self.busy[host] = self.busy.get(host, 0) + 1
        return host

    # ---------------------------------------------------------------------- steps
    def _host_block(self) -> int | None:
        """A free host block, else the least recently used entry's that nothing copies."""
        if self.free:
            return self.free.pop()
        for h, host in self.entries.items():
            if not self.busy.get(host):
                del self.entries[h]
                return host
        return None

    def build_metadata(
        self, num_scheduled: Mapping[str, int], new_req_ids: Sequence[str]
    ) -> OffloadMetadata | None:
        """The step's loads (planned at admission) and the saves of the full blocks its
        requests have after it that the tier lacks."""
        meta, self.planned = self.planned, OffloadMetadata()
        bs, requests = self.block_size, self.context.requests
        for rid in new_req_ids:
            self.queried_tokens += self.asked.pop(rid, 0)
        for rid, n in num_scheduled.items():
            request = requests[rid]
            if not self.kv.uses_prefix_cache(request):
                continue
            # full blocks of known tokens once this step computed its n
            full = min(request.num_computed_tokens + n, request.num_tokens) // bs
            start = self.saved_upto.get(rid, 0)
            if full <= start:
                continue
            hashes = self._hashes(request)
            if self.heads is not None:
                self._save_heads(hashes, start, full, meta)
            for m in self.tables if self.heads is None else ():
                self._save(m, hashes, m.get_block_ids(rid), start, full, meta)
            self.saved_upto[rid] = full
        return meta if meta.loads or meta.saves else None

    def _save(
        self, m: Any, hashes: list, device: list[int], start: int, full: int,
        meta: OffloadMetadata,
    ) -> None:  # fmt: skip
        """Plan the saves of one table's blocks [start, full) that the tier lacks, touching
        the whole chain, last block first: a request's head blocks end most recently used (an
        evicted head would leave the blocks after it unreachable). A window group's blocks
        that left the window (the null block) are not there to save."""
        entries = self.entries
        for i in reversed(range(min(full, len(hashes), len(device)))):
            key = m._key(hashes[i])
            if key in entries:
                entries.move_to_end(key)
                continue
            if i < start or device[i] == self.null_id:  # (a skipped save is not retried)
                continue
            host = self._landing_block(key)
            if host is not None:
                meta.saves.append((device[i], host))

    def _landing_block(self, key: Any) -> int | None:
        """A host block for entry ``key``'s save, the entry landing until the step's results
        come back; None (counted as skipped) when every host block is busy."""
        host = self._host_block()
        if host is None:
            self.skipped_saves += 1
            return None
        self.entries[key] = host
        self.landing[host] = key
        self.busy[host] = self.busy.get(host, 0) + 1
        return host

    def _save_heads(self, hashes: list, start: int, full: int, meta: OffloadMetadata) -> None:
        """``_save`` for KV-Compress: a block is the device prefix cache's entry of its hash
        (one block of every (layer, KV head), ``cached_ids``), saved from the entry, not
        the request's table: an entry keeps the prompt's KVs whole while the request that
        made it is evicted from (it moves to copies, ``detach_own``), and one the device no
        longer caches (it left at an eviction) is not saved."""
        entries = self.entries
        for i in reversed(range(min(full, len(hashes)))):
            key = hashes[i]
            if key in entries:
                entries.move_to_end(key)
                continue
            ids = self.heads.cached_ids(key) if i >= start else None
            host = None if ids is None else self._landing_block(key)
            if host is not None:
                meta.saves.append((i, host))
                meta.save_heads.append(ids.copy())

    def update(self, metadata: OffloadMetadata | None, output: OffloadReport | None) -> None:
        """A step's copies are done: its saved entries become loadable, its host blocks
        evictable."""
        if metadata is None:
            return
        for host, _ in metadata.loads:
            self._release(host)
        for _, host in metadata.saves:
            self.landing.pop(host, None)
            self._release(host)
        self.saved_blocks += len(metadata.saves)
        if output is not None:
            self.host_s += output.host_s

    def _release(self, host: int) -> None:
        left = self.busy.get(host, 0) - 1
        if left > 0:
            self.busy[host] = left
        else:
            self.busy.pop(host, None)
            if host in self.orphans:  # (its entry was forgotten while it was copied)
                self.orphans.discard(host)
                self.free.append(host)

    def on_cache_invalid(self, keys: Sequence[Any]) -> None:
        """Forget the entries of these keys (their device blocks held wrong contents, so a
        save from them copied those): a host block still being copied is freed after."""
        for key in keys:
            host = self.entries.pop(key, None)
            if host is None:
                continue
            if self.landing.get(host) == key:
                del self.landing[host]
            if self.busy.get(host):
                self.orphans.add(host)
            else:
                self.free.append(host)

    # ------------------------------------------------------------------ requests
    def may_swap(self, request: Request) -> bool:
        """The tier is the swap space: a victim whose computed full blocks the tier holds
        (written through, or landing) is preempted by recompute and resumes loading them
        (only its last partial block is computed again); one with blocks the tier lacks (a
        skipped save, an eviction) swaps as the preemption mode says."""
        if not self.kv.uses_prefix_cache(request):
            return True
        full = request.num_computed_tokens // self.block_size
        hashes = self._hashes(request)[:full]
        return any(k not in self.entries for h in hashes for k in self._keys(h))

    def on_preempt(self, request: Request, swapped: bool) -> None:
        """A recomputed request saves again from its first block (hashes already held are
        skipped)."""
        if not swapped:
            self.saved_upto.pop(request.request_id, None)

    def on_free(self, request: Request) -> None:
        self.saved_upto.pop(request.request_id, None)
        self.asked.pop(request.request_id, None)

    def reset(self) -> None:
        """A step failed: entries whose save may not have happened are dropped, nothing is in
        flight any more."""
        for host, h in self.landing.items():
            if self.entries.get(h) == host:
                del self.entries[h]
                self.free.append(host)
        self.landing.clear()
        self.free.extend(self.orphans)
        self.orphans.clear()
        self.busy.clear()
        self.planned = OffloadMetadata()
        self.saved_upto.clear()

    def stats(self) -> dict[str, float]:
        return {
            "offload_hit_tokens": self.hit_tokens,
            "offload_queried_tokens": self.queried_tokens,
            "offload_loaded_blocks": self.loaded_blocks,
            "offload_saved_blocks": self.saved_blocks,
            "offload_skipped_saves": self.skipped_saves,
            "offload_bytes_moved": (self.loaded_blocks + self.saved_blocks) * self.block_bytes,
            "offload_copy_host_s": self.host_s,
            "offload_host_blocks_used": len(self.entries),
        }
