"""Prefill/decode disaggregation, scheduler role: the KV connector ``kv_transfer`` (its worker
role: ``pagedllm/worker/kv_transfer.py``; the file format: ``files.py``; the seam:
``core/sched/connector.py``).

A request says what it wants in ``SamplingParams.extra_args["kv_transfer_params"]`` (vLLM's
key; the proxy fills it in):

- ``{"do_remote_decode": true}`` on a producer: compute the prompt and hand its KV over.
  Every step, the full prompt blocks the step completes are written through to the request's
  rows (``build_metadata`` lists (row, device block) pairs; the worker role writes them after
  the forward pass): into the range of the producer's buffer the transfer got at admission
  when one was free (``arena.py``), else into its file; so a window group's blocks are written
  while the window still holds them. The step that completes the prompt also finalizes the
  file. The response then carries ``{"do_remote_prefill": true, "remote_engine_id",
  "remote_block_file"}`` (``producer_params``), which the proxy passes on to the consumer.
- ``{"do_remote_prefill": true, ...}`` on a consumer: ``add_request`` claims the file, checks
  it (this model's layout, the request's own prompt, not truncated) and refuses the request
  with the reason (ValueError: the engine answers that request with an error, the others go
  on) when the transfer is missing, truncated or foreign. At admission ``external_hit`` offers
  the consecutive blocks after the device prefix hit (and a host tier's) that the file holds
  in every group: a consumer that caches a prefix reads only the rest. ``external_alloc``
  plans their loads, which the worker role makes before the step's forward pass; the file is
  deleted then (or when the request ends first).

KV-Compress (per-head blocks, ``heads``): a row is block i of every (layer, KV head), in the
plain layout (``files.layout_of``), so either side may run without it. A producer's request
is never compressed there (``core/sched/kvc.py``); a consumer computes the prompt's last
``keep_last`` tokens (the observation window, whose queries score the keys its first eviction
keeps) and counts the loaded ones as computed in the runner's table (``count_loaded``).

A producer deletes its own transfers that nobody claimed within ``kv_transfer_timeout``
(the consumer died, or the proxy gave up); a consumer whose producer died finds no file (or,
for rows in a GPU buffer, no live producer) and fails that request alone. A buffer range is
given back once the transfer's files are gone (the consumer deletes them when its copies are
done).

Example (block size 16, a 40-token prompt, the consumer caching the first block): the
producer writes rows 0 and 1 in the prompt's step; the consumer's device hit is 16 tokens,
``external_hit`` gives 16 more (block 1), and the consumer computes tokens 32..39 - its last
token is always computed, for its logits.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagedllm.core.kv_cache.interface import PerHeadRows
from pagedllm.core.kv_transfer.arena import (
    ArenaRanges,
    arena_path,
    check_visible,
    read_handle,
)
from pagedllm.core.kv_transfer.config import KVTransferConfig
from pagedllm.core.kv_transfer.files import (
    TransferHeader,
    layout_of,
    rank_path,
    read_header,
    row_bytes,
    token_digest,
    transfer_name,
)
from pagedllm.core.request import Request
from pagedllm.core.sched.connector import (
    ConnectorContext,
    KVConnectorScheduler,
    block_tables,
    cap_external,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVTransferRoleConfig:
    """The transfer config and what the rows' layout is for this engine's KV groups;
    ``keep_last``: prompt tokens a consumer always computes itself (KV-Compress: its
    observation window, whose queries score the keys it evicts by)."""

    transfer: KVTransferConfig
    layout: str
    block_bytes: int
    keep_last: int = 1
    arena_rows: int = 0  # rows of the producer's buffer (0: none; every row through files)


def kv_transfer_role_config(
    transfer: KVTransferConfig | None, kv_groups: Any, keep_last: int = 1
) -> Any:
    """The role's config (None when the engine has no ``kv_transfer_config``;
    ``keep_last``: ``core/sched/roles.keep_last``)."""
    if transfer is None or kv_groups is None:
        return None
    block_bytes = row_bytes(kv_groups)
    return KVTransferRoleConfig(
        transfer, layout_of(kv_groups, transfer.tp_size), block_bytes, keep_last,
        arena_rows(transfer, block_bytes),
    )  # fmt: skip


def arena_rows(transfer: KVTransferConfig, block_bytes: int) -> int:
    """Rows of a producer's buffer: ``kv_buffer_size`` // row bytes (0 for a consumer).
    Example: 1e9 bytes of 1 MiB rows -> 953 rows (15,248 tokens of block size 16)."""
    if not transfer.is_producer or not transfer.kv_buffer_size:
        return 0
    return int(transfer.kv_buffer_size // max(block_bytes, 1))


def transfer_params(request_params: Any) -> dict | None:
    """The ``kv_transfer_params`` of a request's sampling params (None: none)."""
    extra = getattr(request_params, "extra_args", None)
    params = extra.get("kv_transfer_params") if isinstance(extra, dict) else None
    if params is not None and not isinstance(params, dict):
        raise ValueError("kv_transfer_params must be an object.")
    return params


def producer_params(transfer: KVTransferConfig, request_id: str) -> dict:
    """What a producer's response gives the proxy for the consumer."""
    return {
        "do_remote_prefill": True,
        "remote_engine_id": transfer.engine_id,
        "remote_block_file": transfer_name(transfer.engine_id, request_id),
    }


@dataclass
class Send:
    """A producer request's transfer: its file (before the rank suffix), its header, the
    blocks planned so far, whether the file exists and whether it is published."""

    name: str
    header: TransferHeader
    planned: int = 0
    created: bool = False
    done: bool = False

    @property
    def arena_row(self) -> int:
        return self.header.arena_row


@dataclass
class Receive:
    """A consumer request's claimed transfer: its files' paths template (``{rank}``), where
    the rows start, and which (group, block) rows hold KV."""

    path: str
    header: TransferHeader
    mask: np.ndarray  # [num_groups, num_blocks] bool


@dataclass
class TransferLoad:
    """Rows of one claimed transfer to copy into device blocks before the forward pass; the
    files are deleted after. KV-Compress: ``heads`` [len(rows), LH] the block of each (layer,
    KV head) a row goes to (every rank's heads; the rows' own device entries are unused)."""

    path: str  # with "{rank}"
    rows_offset: int
    num_rows: int
    rows: list[tuple[int, int]]  # (row, device block)
    heads: np.ndarray | None = None
    arena: str = ""  # the producer's buffer holding the rows ("": the file)
    arena_row: int = -1  # its row of row 0
    req_id: str = ""  # the request it goes to (named when the load fails)
    first_block: int = 0  # the request's first block it fills


@dataclass
class TransferSave:
    """Rows of one producer transfer to write after the forward pass; ``header``: create the
    file first; ``final``: the prompt is complete, publish it."""

    path: str  # with "{rank}", before ".tmp"
    header: TransferHeader | None
    mask_offset: int
    rows_offset: int
    num_rows: int
    rows: list[tuple[int, int]]  # (row, device block)
    final: bool
    heads: np.ndarray | None = None  # KV-Compress: as ``TransferLoad.heads``
    arena_row: int = -1  # >= 0: the rows go to this engine's buffer from this row on


@dataclass
class TransferReport:
    """One step's copies on one rank (rank 0's reach the scheduler): host seconds and bytes
    of the loads (read from files into the device cache) and of the saves (waiting for the
    gathered rows, then writing them into files), the saves that failed (by file name) and
    the loads that failed on any rank (request id -> why)."""

    load_s: float = 0.0
    load_bytes: int = 0
    save_s: float = 0.0
    save_bytes: int = 0
    failed: list[str] = field(default_factory=list)
    load_failed: dict[str, str] = field(default_factory=dict)


@dataclass
class TransferMetadata:
    loads: list[TransferLoad] = field(default_factory=list)
    saves: list[TransferSave] = field(default_factory=list)


class KVTransferScheduler(KVConnectorScheduler):
    """Producer and consumer bookkeeping (see the module docstring)."""

    name = "kv_transfer"

    def __init__(self, context: ConnectorContext, config: KVTransferRoleConfig | None) -> None:
        super().__init__(context)
        if config is None:
            raise ValueError("the 'kv_transfer' KV connector needs kv_transfer_config.")
        kv = context.kv_manager
        # KV-Compress's per-head manager: a row is a block index of every (layer, KV head)
        self.heads: PerHeadRows | None = kv if isinstance(kv, PerHeadRows) else None
        self.tables: list[Any] = (
            [kv] if self.heads is not None else block_tables(kv, "kv_transfer_config")
        )
        self.kv = kv
        self.keep_last = config.keep_last
        self.transfer = config.transfer
        self.layout = config.layout
        self.block_bytes = config.block_bytes
        self.block_size = kv.block_size
        self.budget = context.scheduler_config.max_num_batched_tokens
        null = None if self.heads is not None else kv.block_pool.null_block
        self.null_id = -1 if null is None else null.block_id
        self.dir = config.transfer.kv_buffer_path
        os.makedirs(self.dir, exist_ok=True)
        self.sends: dict[str, Send] = {}
        self.receives: dict[str, Receive] = {}
        # the producer's buffer: free ranges, and the published transfers holding one
        self.arena = ArenaRanges(config.arena_rows) if config.arena_rows else None
        self.held: dict[str, tuple[int, int]] = {}  # file name -> (first row, rows)
        self._next_release = 0.0
        self.buffered_transfers = 0
        self.planned = TransferMetadata()
        self._next_sweep = 0.0
        self.sent_transfers = 0
        self.received_tokens = 0
        self.refused_transfers = 0
        self.send_failures = 0
        self.load_s = 0.0
        self.save_s = 0.0
        self.bytes_moved = 0

    # ------------------------------------------------------------------ requests
    def add_request(self, request: Request) -> None:
        """Start a producer's transfer, or claim and check a consumer's (ValueError: the
        request fails alone, with the reason)."""
        params = transfer_params(request.sampling_params)
        if not params or request.seq_index:
            return
        rid = request.request_id
        if params.get("do_remote_decode"):
            if not self.transfer.is_producer:
                raise ValueError(
                    "kv_transfer_params.do_remote_decode: this engine is not a KV producer "
                    f"(kv_role {self.transfer.kv_role!r})."
                )
            n = request.num_prompt_tokens // self.block_size
            start = self.arena.take(n * len(self.tables)) if self.arena and n else -1
            header = TransferHeader(
                self.layout, self.block_size, self.block_bytes, len(self.tables), n,
                token_digest(request.prompt_token_ids[: n * self.block_size]),
                self.transfer.engine_id if start >= 0 else "", start,
            )  # fmt: skip
            self.sends[rid] = Send(transfer_name(self.transfer.engine_id, rid), header)
            self.buffered_transfers += start >= 0
        elif params.get("do_remote_prefill"):
            if not self.transfer.is_consumer:
                raise ValueError(
                    "kv_transfer_params.do_remote_prefill: this engine is not a KV consumer "
                    f"(kv_role {self.transfer.kv_role!r})."
                )
            self.receives[rid] = self._claim(request, params)

    def _claim(self, request: Request, params: dict) -> Receive:
        name = params.get("remote_block_file")
        if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
            raise ValueError(
                "kv_transfer_params.remote_block_file must be the producer's file name, got "
                f"{name!r}."
            )
        # claimed: "<name>.r<rank>.<this engine's id>" (the producer's sweep leaves it)
        claimed = rank_path(self.dir, name, "{rank}") + f".{self.transfer.engine_id}"
        taken: list[str] = []
        try:
            for r in range(self.transfer.tp_size):
                try:
                    os.rename(rank_path(self.dir, name, r), claimed.format(rank=r))
                except FileNotFoundError:
                    raise ValueError(
                        f"the KV transfer {name} is not in {self.dir}: the prefill engine "
                        "failed or timed out, or another request took it."
                    ) from None
                taken.append(claimed.format(rank=r))
                os.utime(taken[-1])  # (the producer's sweep counts a claim's age from now)
            header, mask = read_header(taken[0])
            for path in taken[1:]:
                other, other_mask = read_header(path)
                if other != header:
                    raise ValueError(f"the KV transfer {name}'s ranks disagree.")
                mask &= other_mask
            if header.layout != self.layout:
                raise ValueError(
                    f"the KV transfer {name} was computed by an engine with another KV "
                    f"layout ({header.layout}, this engine: {self.layout}): not the same "
                    "model, dtype, block size or tensor-parallel size."
                )
            n = header.num_blocks * header.block_size
            prompt = request.prompt_token_ids
            if n > len(prompt) or token_digest(prompt[:n]) != header.tokens:
                raise ValueError(f"the KV transfer {name} is of another prompt.")
            for r in range(self.transfer.tp_size if header.arena else 0):
                handle = read_handle(arena_path(self.dir, header.arena, r))
                check_visible(handle, header.arena)
                if (
                    int(handle["row_bytes"]) != header.block_bytes
                    or int(handle["rows"]) < header.arena_row + header.num_rows
                ):
                    raise ValueError(
                        f"the KV transfer {name}'s rows are not in its producer's buffer "
                        "(the prefill engine restarted with another kv_buffer_size?)."
                    )
        except (ValueError, OSError) as e:
            self.refused_transfers += 1
            for path in taken:
                _unlink(path)
            if isinstance(e, ValueError):
                raise
            raise ValueError(f"the KV transfer {name} could not be read: {e}") from None
        return Receive(claimed, header, mask)

    # ------------------------------------------------------------------ admission
    def external_hit(self, request: Request, num_device_hit: int) -> int:
        """Tokens after ``num_device_hit`` (block-aligned) whose blocks the transfer holds in
        every group, consecutively, up to the last full block before the prompt's last
        token; no more than the free blocks hold beside a chunk."""
        got = self.receives.get(request.request_id)
        if got is None:
            return 0
        bs = self.block_size
        first = num_device_hit // bs
        last = min(got.header.num_blocks, (request.num_tokens - self.keep_last) // bs)
        n = 0
        while first + n < last and got.mask[:, first + n].all():
            n += 1
        n = cap_external(
            self.kv, self.heads, len(self.tables), self.budget, request, num_device_hit, n
        )
        return n * bs

    def external_alloc(self, request: Request, num_device_hit: int, num_tokens: int) -> None:
        """Plan the loads of the ``num_tokens`` tokens after ``num_device_hit`` into the
        request's new device blocks (this step, before the forward pass)."""
        got = self.receives.pop(request.request_id)
        bs, nb = self.block_size, got.header.num_blocks
        first, n = num_device_hit // bs, num_tokens // bs
        rows, heads = [], None
        if self.heads is not None:  # (one group: row i is block i)
            heads = self.heads.block_columns(request.request_id, first, n)
            rows = [(first + i, -1) for i in range(n)]
            self.heads.count_loaded(request.request_id, num_tokens)
        for g, m in enumerate(self.tables if heads is None else ()):
            device = m.get_block_ids(request.request_id)[first : first + n]
            rows += [(g * nb + first + i, d) for i, d in enumerate(device)]
        h = got.header
        load = TransferLoad(
            got.path, h.rows_offset(), h.num_rows, rows, heads, h.arena, h.arena_row,
            request.request_id, first,
        )  # fmt: skip
        self.planned.loads.append(load)
        self.received_tokens += num_tokens

    # ---------------------------------------------------------------------- steps
    def begin_step(self) -> None:
        """Now and then, delete this producer's transfers nobody claimed in time; every few
        milliseconds, give back the buffer ranges of the transfers whose files are gone."""
        now = time.monotonic()
        if self.transfer.is_producer and now >= self._next_sweep:
            self._next_sweep = now + min(10.0, self.transfer.kv_transfer_timeout / 4)
            self._sweep()
        if self.held and now >= self._next_release:
            self._next_release = now + 0.005
            self._release_held()

    def _release_held(self) -> None:
        """Published transfers in the buffer whose files (every rank's, published or
        claimed) are gone: the consumer has copied their rows, or the sweep gave up on them."""
        try:
            names = os.listdir(self.dir)
        except OSError:
            return
        present = {n.partition(".kv.r")[0] + ".kv" for n in names if ".kv.r" in n}
        for name in [n for n in self.held if n not in present]:
            assert self.arena is not None
            self.arena.give(*self.held.pop(name))

    def _sweep(self) -> None:
        """Names: "<name>.r<rank>" published, "...tmp" being written (a live request's are
        skipped), "...<consumer id>" claimed: the consumer's, deleted only far past the
        timeout (its consumer died holding it)."""
        prefix, now = f"{self.transfer.engine_id}-", time.time()
        live = {s.name for s in self.sends.values() if not s.done}
        try:
            names = os.listdir(self.dir)
        except OSError:
            return
        for name in names:
            base, _, rest = name.partition(".kv.r")
            if not name.startswith(prefix) or not rest or base + ".kv" in live:
                continue
            path = os.path.join(self.dir, name)
            try:
                age = now - os.stat(path).st_mtime
            except OSError:
                continue
            claimed = "." in rest and not rest.endswith(".tmp")
            if age > self.transfer.kv_transfer_timeout * (10 if claimed else 1):
                _unlink(path)

    def build_metadata(
        self, num_scheduled: Mapping[str, int], new_req_ids: Sequence[str]
    ) -> TransferMetadata | None:
        """The step's loads (planned at admission) and the producer rows it completes."""
        meta, self.planned = self.planned, TransferMetadata()
        bs = self.block_size
        for rid, send in self.sends.items():
            n = num_scheduled.get(rid)
            if n is None or send.done:
                continue
            request, h = self.context.requests[rid], send.header
            computed = request.num_computed_tokens + n
            full = min(computed // bs, h.num_blocks)
            rows, heads = [], None
            if self.heads is not None and full > send.planned:
                heads = self.heads.block_columns(rid, send.planned, full - send.planned)
                rows = [(i, -1) for i in range(send.planned, full)]
            for g, m in enumerate(self.tables if self.heads is None else ()):
                device = m.get_block_ids(rid)
                rows += [
                    (g * h.num_blocks + i, device[i])
                    for i in range(send.planned, full)
                    if device[i] != self.null_id  # (a window group's block that left)
                ]
            send.done = computed >= request.num_prompt_tokens
            path = rank_path(self.dir, send.name, "{rank}")
            meta.saves.append(
                TransferSave(
                    path, None if send.created else h, h.mask_offset(), h.rows_offset(),
                    h.num_rows, rows, send.done, heads, h.arena_row,
                )
            )  # fmt: skip
            send.created, send.planned = True, full
            self.sent_transfers += send.done
        return meta if meta.loads or meta.saves else None

    def update(self, metadata: TransferMetadata | None, output: TransferReport | None) -> None:
        """Add the step's copy times and bytes; count the writes the worker role could not
        make (the consumer will find no file and fail that request); end the requests whose
        loads failed (``_fail_loads``)."""
        if output is None:
            return
        self.load_s += output.load_s
        self.save_s += output.save_s
        self.bytes_moved += output.load_bytes + output.save_bytes
        if output.failed:
            self.send_failures += len(output.failed)
            logger.warning("KV transfers not written: %s", ", ".join(output.failed))
        if output.load_failed and metadata is not None:
            self._fail_loads(metadata, output.load_failed)

    def _fail_loads(self, metadata: TransferMetadata, errors: Mapping[str, str]) -> None:
        """Loads that failed after their claim (the file gone, a short read, a buffer that
        would not open on some rank): their blocks from the first loaded one on hold wrong
        KVs, and so do the blocks computed over them. Each such request ends with the reason,
        and so does every live request holding one of those blocks (a prefix hit on them
        since), its own later blocks counted too, until no more are found; the blocks leave
        the prefix cache and every role forgets copies of them (a host tier's saves). The
        others go on. KV-Compress's per-head blocks: the step fails instead (every running
        request ends, the prefix cache is emptied), as any failed step.
        Example (bs 16): A loaded blocks 2.. of its table [7, 8, 9, 10] and failed; B hit A's
        first three blocks [7, 8, 9] and computed [11]: bad {9, 10}, then B (from block 2)
        adds {11}; A and B end, 7 and 8 stay cached."""
        reasons = "; ".join(f"{rid}: {why}" for rid, why in errors.items())
        if self.heads is not None or self.context.fail is None:
            raise RuntimeError(f"KV transfer loads failed ({reasons})")
        todo = {ld.req_id: ld.first_block for ld in metadata.loads if ld.req_id in errors}
        ended = {
            rid: f"the KV transfer from the prefill engine could not be loaded: {why}"
            for rid, why in errors.items()
        }
        bad: set[int] = set()
        done: set[str] = set()
        while todo:
            for rid, first in todo.items():
                for m in self.tables:
                    bad.update(b for b in m.get_block_ids(rid)[first:] if b != self.null_id)
            done.update(todo)
            todo = {}
            for rid in self.context.requests:
                if rid in done:
                    continue
                firsts = [
                    next((i for i, b in enumerate(m.get_block_ids(rid)) if b in bad), None)
                    for m in self.tables
                ]
                hits = [i for i in firsts if i is not None]
                if hits:
                    todo[rid] = min(hits)
                    ended[rid] = (
                        "its prompt shared KV blocks with a request whose KV transfer could "
                        f"not be loaded ({reasons})"
                    )
        logger.warning("KV transfer loads failed (%s): ending %s", reasons, ", ".join(ended))
        self.context.fail(ended, self.kv.uncache_blocks(sorted(bad)))

    # ------------------------------------------------------------------ requests
    def on_preempt(self, request: Request, swapped: bool) -> None:
        """A producer request recomputed keeps its written rows (the same KV); a consumer
        request that had not loaded yet keeps its claim."""

    def on_free(self, request: Request) -> None:
        """A producer's unfinished file goes (the worker role skips its later writes) and its
        buffer range with it; a finished one's range is held until its files are gone. A
        consumer's claimed file nobody loaded goes."""
        rid = request.request_id
        send = self.sends.pop(rid, None)
        if send is not None and send.created and not send.done:
            for r in range(self.transfer.tp_size):
                _unlink(rank_path(self.dir, send.name, r) + ".tmp")
        if send is not None and send.arena_row >= 0:
            assert self.arena is not None
            span = (send.arena_row, send.header.num_rows)
            if send.done:
                self.held[send.name] = span
            else:  # (this engine's later gathers into it are queued behind this step's)
                self.arena.give(*span)
        got = self.receives.pop(rid, None)
        if got is not None:  # ended before its first step: nobody will load it
            for r in range(self.transfer.tp_size):
                _unlink(got.path.format(rank=r))

    def reset(self) -> None:
        """A step failed: its requests end (on_free drops their state)."""
        self.planned = TransferMetadata()

    def stats(self) -> dict[str, float]:
        return {
            "kv_transfer_sent": self.sent_transfers,
            "kv_transfer_received_tokens": self.received_tokens,
            "kv_transfer_refused": self.refused_transfers,
            "kv_transfer_send_failures": self.send_failures,
            "kv_transfer_load_s": self.load_s,
            "kv_transfer_save_s": self.save_s,
            "kv_transfer_bytes": self.bytes_moved,
            "kv_transfer_buffered": self.buffered_transfers,
        }


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
