"""Prefill/decode disaggregation, worker role: the copies between this rank's KV cache and
the transfer files (the bookkeeping: ``core/kv_transfer/scheduler.py``; the format:
``core/kv_transfer/files.py``).

A transfer's rows are in the producer's buffer (``kv_buffer_size``, ``worker/kv_arena.py``)
when the scheduler placed them there, else in its file:

- Buffer, producer: after the forward pass the device blocks are gathered block-major
  straight into the transfer's range (on a GPU one launch for every layer,
  ``ops/block_rows.py``, queued on the compute stream); ``finish`` writes the file's header
  and mask once the step's device work is done.
- Buffer, consumer: before the forward pass the rows are scattered from the producer's
  buffer (opened by CUDA IPC on a GPU) into their blocks, a run of consecutive buffer rows at
  a time: straight from it on the same GPU, through a staging copy from another; the files
  are deleted at ``finish``, once those copies have run (which gives the producer its range
  back).

Every copy through a file goes through a ring of two host buffers (``RING_BYTES`` each,
pinned on a GPU), made once: a chunk of rows at a time, one buffer filled while the other's
copy to or from the device is in flight. Pinning memory runs at a few GB/s: a buffer of the
request's size per copy (500 MB for a 4,000-token Llama-3.1-8B prompt) would cost more than
the copy.

- Loads (consumer), before the forward pass: each chunk is read from the claimed file (one
  read per run of consecutive rows) into a ring buffer, copied to the device (no host sync)
  and scattered into its blocks; then the file is deleted.
- Saves (producer), after the forward pass: the device blocks are gathered block-major on
  the compute stream; at ``finish`` (the step's device work done, before its results reach
  the scheduler) each chunk is copied into a ring buffer on a side stream (the next step's
  forward pass is not waited for) and written into the file (one write per run); the file
  is published (renamed from ``.tmp``) before the response that names it leaves the engine.
Plain reads and writes, not memory maps: the first touch of a mapped page costs a fault,
and a full disk is an error to report, not a SIGBUS. A write that fails (the request was
aborted and its file deleted, a full disk) is reported by name, never raised: it fails that
transfer only.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedllm.core.kv_transfer.files import row_bytes
from pagedllm.core.kv_transfer.scheduler import (
    TransferLoad,
    TransferMetadata,
    TransferReport,
    TransferSave,
    arena_rows,
)
from pagedllm.distributed.parallel_state import all_reduce_max, tp_info
from pagedllm.kv_layout import copy_dtype
from pagedllm.ops.kv_rows import move_block_rows
from pagedllm.utils.pinned import PinnedRing
from pagedllm.worker.head_rows import HeadRows
from pagedllm.worker.kv_arena import ArenaViews, ProducerArena
from pagedllm.worker.kv_connector import KVConnectorWorker, StepBatch
from pagedllm.worker.offload import host_runs, page_layout

logger = logging.getLogger(__name__)


@dataclass
class PendingWrites:
    """A step's saves in flight: each save with its gathered rows ``[n, block_bytes]`` (on
    the device; ready once ``event``, recorded after the gathers, is done)."""

    saves: list[tuple[TransferSave, torch.Tensor | None]]  # None: rows in the buffer
    event: Any
    report: TransferReport
    loaded: list[str]  # the files of the step's loads from buffers (deleted at finish)
    timed: list[tuple[str, Any, Any]]  # ("load" | "save", start, end): buffer copies (GPU)


class KVTransferWorker(KVConnectorWorker):
    """Reads and writes transfer files for this rank (see the module docstring)."""

    name = "kv_transfer"

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.device: torch.device = runner.device
        self.cuda = self.device.type == "cuda"
        self.ids = PinnedRing(self.device, 1024)  # block ids to the device without a wait
        self.dtype: torch.dtype = copy_dtype(runner.kv_dtype)  # uint8 for an fp8 cache
        # KV-Compress: the per-head blocks gathered into / scattered from the plain rows
        self.per_head = runner.kv_groups.head_paged is not None
        self._head_rows: HeadRows | None = None
        if self.per_head:
            self.block_bytes = row_bytes(runner.kv_groups)
        else:
            self.block_bytes = page_layout(runner.kv_groups, self.dtype)[1]
        self.rank, self.tp_world = tp_info()
        self.side = torch.cuda.Stream(self.device) if self.cuda else None
        self._load: tuple[float, int] = (0.0, 0)  # (host seconds, bytes) of this step's loads
        # two host buffers of ring_rows rows (pinned on a GPU), made once and reused by every
        # copy between files and the device: pinning memory runs at a few GB/s, so a buffer
        # of the request's size each time would cost more than the copy
        self.ring_rows = max(1, self.RING_BYTES // max(self.block_bytes, 1))
        self._ring: list[torch.Tensor] = []
        self._ring_events: list[Any] = [None, None]
        # the producer's buffer (made now: before the KV cache is sized), producers' buffers
        transfer = runner.cache_config.kv_transfer
        n = arena_rows(transfer, self.block_bytes)
        self.arena: ProducerArena | None = None
        if n:
            self.arena = ProducerArena(
                transfer.kv_buffer_path, transfer.engine_id, self.rank, n, self.block_bytes,
                self.device,
            )  # fmt: skip
        self.views = ArenaViews(transfer.kv_buffer_path, self.rank)
        self._loaded: list[str] = []  # this step's loads from buffers: their files
        self._failed: dict[str, str] = {}  # this step's loads that failed: request id -> why
        self._j = 0  # the ring buffer the next chunk of a file's load goes through (j % 2)
        self._timed: list[tuple[str, Any, Any]] = []

    RING_BYTES = 64 << 20

    @property
    def head_rows(self) -> HeadRows:
        """KV-Compress's rows over the runner's per-head cache (made at first use: the cache
        comes after the connectors)."""
        if self._head_rows is None:
            self._head_rows = HeadRows(self.runner.kv_layout, self.ids)
        return self._head_rows

    def _slot(self, j: int) -> torch.Tensor:
        """Ring buffer ``j % 2`` once the copy that last used it is done."""
        if not self._ring:
            self._ring = [
                torch.empty(
                    self.ring_rows, self.block_bytes, dtype=torch.uint8, pin_memory=self.cuda
                )  # fmt: skip
                for _ in range(2)
            ]
        event = self._ring_events[j % 2]
        if event is not None:
            event.synchronize()
            self._ring_events[j % 2] = None
        return self._ring[j % 2]

    def _copied(self, j: int, stream: Any) -> None:
        """The copy from or into ring buffer ``j % 2`` is queued on ``stream`` (GPU)."""
        if self.cuda:
            event = torch.cuda.Event()
            event.record(stream)
            self._ring_events[j % 2] = event

    @classmethod
    def for_runner(cls, runner: Any) -> KVTransferWorker:
        return cls(runner)

    def before_forward(self, so: Any, metadata: TransferMetadata | None, batch: StepBatch) -> None:
        """Copy the step's loads into their device blocks, then delete their files: a chunk
        of ``ring_rows`` rows at a time, read into a ring buffer (one read per run of
        consecutive rows), copied to the device without a host sync on a GPU, scattered
        into its blocks. A load that fails (a file gone or short, a buffer that will not
        open) is reported by request, never raised; with tensor parallelism the ranks'
        failures are merged (one all-reduce on a step with loads), so every rank reports
        the same requests."""
        if metadata is None or not metadata.loads:
            return
        host_s, nbytes = 0.0, 0
        stream = torch.cuda.current_stream(self.device) if self.cuda else None
        failed = np.zeros(len(metadata.loads), np.int64)
        why: dict[str, str] = {}
        for i, load in enumerate(metadata.loads):
            try:
                n, s = self._load_one(load, stream)
                nbytes, host_s = nbytes + n, host_s + s
            except (OSError, EOFError, RuntimeError, ValueError) as e:
                # this request's blocks are left part-written: it alone fails (the
                # scheduler ends it and forgets its blocks' cache entries)
                logger.warning("KV transfer load for %s failed: %s", load.req_id, e)
                failed[i], why[load.req_id] = 1, str(e)
                try:  # (nobody will read it: a buffer's producer gets its range back)
                    os.unlink(load.path.format(rank=self.rank))
                except OSError:
                    pass
        if self.tp_world > 1:  # a load that failed on any rank fails on every rank
            flags = torch.from_numpy(failed).to(self.device)
            failed = all_reduce_max(flags).cpu().numpy()
        self._failed = {
            load.req_id: why.get(load.req_id, "the KV transfer failed on another rank")
            for load, bad in zip(metadata.loads, failed)
            if bad
        }
        self._load = (host_s, nbytes)

    def _load_one(self, load: TransferLoad, stream: Any) -> tuple[int, float]:
        """One load, from the producer's buffer or from its file a chunk at a time (the file
        deleted after); (bytes, host seconds: 0 where CUDA events time a buffer's copies).
        Raises where it fails (the caller deletes the file)."""
        path = load.path.format(rank=self.rank)
        if load.arena:
            if not os.path.exists(path):  # (the producer's sweep gave up on the claim:
                # its range may hold another transfer's rows by now)
                raise FileNotFoundError(f"the KV transfer {path} is gone")
            start, t0 = self._event(), time.perf_counter()
            nbytes = self._load_from_arena(load)
            self._loaded.append(path)
            if start is not None:  # (device time: the forward pass waits for it)
                self._timed.append(("load", start, self._event()))
                return nbytes, 0.0
            return nbytes, time.perf_counter() - t0
        t0, nbytes = time.perf_counter(), 0
        fd = os.open(path, os.O_RDONLY) if load.rows else -1
        try:
            for c0 in range(0, len(load.rows), self.ring_rows):
                chunk = load.rows[c0 : c0 + self.ring_rows]
                buf = self._slot(self._j)[: len(chunk)]
                host = buf.numpy()
                for first, pos, n in host_runs([r for r, _ in chunk]):
                    at = load.rows_offset + first * self.block_bytes
                    _pread_into(fd, host[pos : pos + n], at)
                rows = buf.to(self.device, non_blocking=True) if self.cuda else buf
                self._copied(self._j, stream)
                self._j += 1
                self._scatter(rows, load, c0, len(chunk))
                nbytes += buf.numel()
        finally:
            if fd >= 0:
                os.close(fd)
        try:
            os.unlink(path)
        except OSError:
            pass
        return nbytes, time.perf_counter() - t0

    def _load_from_arena(self, load: TransferLoad) -> int:
        """Scatter a load's rows from the producer's buffer into their blocks, a run of
        consecutive buffer rows at a time: straight from the buffer where it is on this device
        (or the shared-memory file on a CPU); from another GPU through a staging copy of
        ``ring_rows`` rows at most. The bytes."""
        try:
            src = self.views.rows(load.arena)  # [buffer rows, row_bytes]
        except (RuntimeError, ValueError) as e:
            raise RuntimeError(
                f"the prefill engine's KV buffer {load.arena} could not be opened ({e}); the "
                "decode engine must see the prefill engine's GPU (CUDA IPC), or give the "
                "prefill engine kv_buffer_size 0 (transfers through files)."
            ) from e
        here = self.device
        if here.type == "cuda" and here.index is None:
            here = torch.device("cuda", torch.cuda.current_device())
        step = self.ring_rows if src.device != here else len(load.rows)
        for first, pos, n in host_runs([load.arena_row + r for r, _ in load.rows]):
            for c0 in range(0, n, step):
                m = min(step, n - c0)
                rows = src[first + c0 : first + c0 + m]
                if rows.device != here:  # (another GPU's: peer to peer, ring_rows at a time)
                    rows = rows.to(here, non_blocking=True)
                self._scatter(rows, load, pos + c0, m)
        return len(load.rows) * self.block_bytes

    def _scatter(self, rows: torch.Tensor, load: TransferLoad, c0: int, n: int) -> None:
        """Rows ``[n, block_bytes]`` (on the device) of ``load.rows[c0 : c0 + n]`` into their
        device blocks."""
        heads = None if load.heads is None else load.heads[c0 : c0 + n]
        self._move(load.rows[c0 : c0 + n], heads, rows, to_rows=False)

    def _move(self, pairs: list[tuple[int, int]], heads: np.ndarray | None,
              rows: torch.Tensor, to_rows: bool) -> None:  # fmt: skip
        """Rows ``[n, block_bytes]`` from (``to_rows``) or into the device blocks of ``pairs``
        ((row, device block) each; KV-Compress: each (layer, KV head)'s block in ``heads``
        [n, LH]); on a GPU every layer in one launch (``ops/block_rows.py``)."""
        if not pairs:
            return
        if heads is not None:
            if to_rows:
                self.head_rows.gather(heads, rows)
            else:
                self.head_rows.scatter(rows, heads, np.fromiter((r for r, _ in pairs), np.int64))
            return
        ids = self.ids.ship(np.fromiter((d for _, d in pairs), np.int64))
        move_block_rows(self.runner.kv_layout.copy_tensors, ids, rows, to_rows)

    def after_forward(self, so: Any, metadata: TransferMetadata | None) -> PendingWrites | None:
        """Gather the step's saved blocks (block-major, to host memory)."""
        report = TransferReport(load_s=self._load[0], load_bytes=self._load[1])
        report.load_failed, self._failed = self._failed, {}
        loaded, self._load, self._loaded = self._loaded, (0.0, 0), []
        timed, self._timed = self._timed, []
        if metadata is None or not metadata.saves:
            if not (report.load_bytes or loaded or report.load_failed):
                return None
            return PendingWrites([], self._event(), report, loaded, timed)
        gathered: list[tuple[TransferSave, torch.Tensor | None]] = []
        for save in metadata.saves:
            if save.arena_row >= 0 and self.arena is not None:  # into the buffer's rows
                start, t0 = self._event(), time.perf_counter()
                for first, pos, n in host_runs([save.arena_row + r for r, _ in save.rows]):
                    self._gather(save, pos, n, self.arena.rows[first : first + n])
                if start is not None:
                    timed.append(("save", start, self._event()))
                else:
                    report.save_s += time.perf_counter() - t0
                gathered.append((save, None))
                report.save_bytes += len(save.rows) * self.block_bytes
                continue
            rows = torch.empty(len(save.rows), self.block_bytes, dtype=torch.uint8,
                               device=self.device)  # fmt: skip
            self._gather(save, 0, len(save.rows), rows)
            gathered.append((save, rows))
        if self.cuda:
            assert self.side is not None
            for _, rows in gathered:  # (read on the side stream at finish)
                if rows is not None:
                    rows.record_stream(self.side)
        return PendingWrites(gathered, self._event(), report, loaded, timed)

    def _gather(self, save: TransferSave, pos: int, n: int, dst: torch.Tensor) -> None:
        """The device blocks of ``save.rows[pos : pos + n]`` into ``dst`` ``[n, block_bytes]``
        (block-major)."""
        heads = None if save.heads is None else save.heads[pos : pos + n]
        self._move(save.rows[pos : pos + n], heads, dst, to_rows=True)

    def _event(self) -> Any:
        """An event after the work queued so far on the compute stream (None off a GPU)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def finish(self, pending: PendingWrites | None) -> TransferReport | None:
        """Write the gathered rows into their files (publishing the complete ones); the
        report (with the names of the writes that failed)."""
        if pending is None:
            return None
        report = pending.report
        if pending.event is not None:
            pending.event.synchronize()  # the gathers and copies (not the writes' time)
        for kind, start, end in pending.timed:  # the buffer copies' device time
            if kind == "load":
                report.load_s += start.elapsed_time(end) / 1e3
            else:
                report.save_s += start.elapsed_time(end) / 1e3
        for path in pending.loaded:  # (their rows are copied: the producer may reuse them)
            try:
                os.unlink(path)
            except OSError:
                pass
        t0 = time.perf_counter()
        for save, rows in pending.saves:
            path = save.path.format(rank=self.rank)
            try:
                self._write(save, path, rows)
                report.save_bytes += 0 if rows is None else rows.numel()
            except OSError as e:
                logger.warning("KV transfer %s not written: %s", path, e)
                report.failed.append(os.path.basename(path))
        if pending.saves:
            report.save_s += time.perf_counter() - t0
        return report

    def _host_rows(self, rows: torch.Tensor, c0: int, m: int, j: int) -> np.ndarray:
        """Rows ``[c0, c0 + m)`` on the host: a view on a CPU; on a GPU copied into a ring
        buffer on the side stream (the compute stream runs the next step meanwhile)."""
        if not self.cuda:
            return rows[c0 : c0 + m].numpy()
        buf = self._slot(j)[:m]
        with torch.cuda.stream(self.side):
            buf.copy_(rows[c0 : c0 + m], non_blocking=True)
        self._copied(j, self.side)
        self._slot(j)  # (waits for that copy)
        return buf.numpy()

    def _write(self, save: TransferSave, path: str, rows: torch.Tensor | None) -> None:
        """The rows (a ring chunk at a time, one write per run of consecutive rows; none when
        they are in the buffer) and their mask bytes; the header first when the file is new
        (sized now, sparse: a full disk is an OSError of a write, never a fault), the rename
        when the prompt is complete."""
        tmp = path + ".tmp"
        flags = os.O_WRONLY | (os.O_CREAT | os.O_TRUNC if save.header is not None else 0)
        fd = os.open(tmp, flags, 0o600)  # (FileNotFoundError: its request ended)
        try:
            if save.header is not None:
                _pwrite_all(fd, save.header.encode(), 0)
                os.ftruncate(fd, save.header.file_size())
            for j, c0 in enumerate(range(0, len(save.rows), self.ring_rows)):
                chunk = save.rows[c0 : c0 + self.ring_rows]
                host = None if rows is None else self._host_rows(rows, c0, len(chunk), j)
                for first, pos, n in host_runs([r for r, _ in chunk]):
                    if host is not None:
                        at = save.rows_offset + first * self.block_bytes
                        _pwrite_all(fd, host[pos : pos + n], at)
                    _pwrite_all(fd, b"\x01" * n, save.mask_offset + first)
        finally:
            os.close(fd)
        if save.final:
            os.replace(tmp, path)


def _pwrite_all(fd: int, data: Any, offset: int) -> None:
    """Write all of ``data`` (bytes or a C-contiguous array) at ``offset``."""
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _pread_into(fd: int, out: np.ndarray, offset: int) -> None:
    """Fill ``out`` (C-contiguous) from the file at ``offset`` (EOFError if it ends first)."""
    view = memoryview(out).cast("B")
    while view:
        n = os.preadv(fd, [view], offset)
        if n == 0:
            raise EOFError(f"a KV transfer ended {len(view)} bytes early")
        view, offset = view[n:], offset + n
