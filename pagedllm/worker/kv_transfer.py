"""Prefill/decode disaggregation, worker role: the copies between this rank's KV cache and
the transfer files (the bookkeeping: ``core/kv_transfer/scheduler.py``; the format:
``core/kv_transfer/files.py``).

- Loads (consumer), before the forward pass: the rows are read from the claimed file (one
  read per run of consecutive rows, straight into pinned memory on a GPU), copied into their
  device blocks, and the file is deleted.
- Saves (producer), after the forward pass: the device blocks are gathered block-major (on
  a GPU into pinned memory on a side stream), and written into the file's rows at ``finish``
  (one write per run), when the step's device work is done and before its results reach the
  scheduler: the file is published (renamed from ``.tmp``) before the response that names it
  leaves the engine.
Plain reads and writes, not memory maps: the first touch of a mapped page costs a fault
(the H100 run of the mapped version moved 1.4-1.8 GB/s where the machine copies files at
~10), and a full disk is an error to report, not a SIGBUS.
A write that fails (the request was aborted and its file deleted, a full disk) is reported
by name, never raised: it fails that transfer only.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedllm.core.kv_transfer.scheduler import TransferMetadata, TransferReport, TransferSave
from pagedllm.distributed.parallel_state import tp_info
from pagedllm.worker.kv_connector import KVConnectorWorker, StepBatch
from pagedllm.worker.offload import block_views, host_runs, page_layout

logger = logging.getLogger(__name__)


@dataclass
class PendingWrites:
    """A step's saves in flight: each save with its gathered rows ``[n, block_bytes]`` (host
    memory; filled once ``event`` is done on a GPU)."""

    saves: list[tuple[TransferSave, torch.Tensor]]
    event: Any
    report: TransferReport


class KVTransferWorker(KVConnectorWorker):
    """Reads and writes transfer files for this rank (see the module docstring)."""

    name = "kv_transfer"

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.device: torch.device = runner.device
        self.cuda = self.device.type == "cuda"
        self.dtype: torch.dtype = runner.model_config.torch_dtype
        self.pages, self.block_bytes = page_layout(runner.kv_groups, self.dtype)
        self.rank = tp_info()[0]
        self.side = torch.cuda.Stream(self.device) if self.cuda else None
        self._load: tuple[float, int] = (0.0, 0)  # (host seconds, bytes) of this step's loads

    @classmethod
    def for_runner(cls, runner: Any) -> KVTransferWorker:
        return cls(runner)

    def before_forward(self, so: Any, metadata: TransferMetadata | None, batch: StepBatch) -> None:
        """Copy the step's loads into their device blocks, then delete their files."""
        if metadata is None or not metadata.loads:
            return
        t0, nbytes = time.perf_counter(), 0
        tensors = self.runner.kv_layout.tensors
        for load in metadata.loads:
            path = load.path.format(rank=self.rank)
            if load.rows:
                rows = torch.empty(len(load.rows), self.block_bytes, dtype=torch.uint8,
                                   pin_memory=self.cuda)  # fmt: skip
                buf = rows.numpy()
                fd = os.open(path, os.O_RDONLY)
                try:  # one read per run of consecutive rows, straight into (pinned) memory
                    for first, pos, n in host_runs([r for r, _ in load.rows]):
                        at = load.rows_offset + first * self.block_bytes
                        _pread_into(fd, buf[pos : pos + n], at)
                finally:
                    os.close(fd)
                nbytes += rows.numel()
                if self.cuda:
                    rows = rows.to(self.device, non_blocking=True)
                dst = torch.tensor([d for _, d in load.rows], device=self.device)
                for dev, src in zip(tensors, block_views(self.pages, self.dtype, rows)):
                    dev.index_copy_(1, dst, src)
            try:
                os.unlink(path)
            except OSError:
                pass
        self._load = (time.perf_counter() - t0, nbytes)

    def after_forward(self, so: Any, metadata: TransferMetadata | None) -> PendingWrites | None:
        """Gather the step's saved blocks (block-major, to host memory)."""
        report = TransferReport(load_s=self._load[0], load_bytes=self._load[1])
        self._load = (0.0, 0)
        if metadata is None or not metadata.saves:
            return PendingWrites([], None, report) if report.load_bytes else None
        tensors = self.runner.kv_layout.tensors
        gathered, event = [], None
        for save in metadata.saves:
            src = torch.tensor([d for _, d in save.rows], dtype=torch.long, device=self.device)
            rows = torch.empty(len(save.rows), self.block_bytes, dtype=torch.uint8,
                               device=self.device)  # fmt: skip
            for dev, view in zip(tensors, block_views(self.pages, self.dtype, rows)):
                view.copy_(dev.index_select(1, src))
            gathered.append([save, rows])
        if self.cuda and gathered:
            assert self.side is not None
            self.side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.side):
                for item in gathered:
                    item[1].record_stream(self.side)
                    host = torch.empty(item[1].shape, dtype=torch.uint8, pin_memory=True)
                    host.copy_(item[1], non_blocking=True)
                    item[1] = host
                event = torch.cuda.Event()
                event.record(self.side)
        return PendingWrites([(s, r) for s, r in gathered], event, report)

    def finish(self, pending: PendingWrites | None) -> TransferReport | None:
        """Write the gathered rows into their files (publishing the complete ones); the
        report (with the names of the writes that failed)."""
        if pending is None:
            return None
        report = pending.report
        if pending.event is not None:
            pending.event.synchronize()  # (the step's forward pass too: not the writes' time)
        t0 = time.perf_counter()
        for save, rows in pending.saves:
            path = save.path.format(rank=self.rank)
            try:
                self._write(save, path, rows.numpy())
                report.save_bytes += rows.numel()
            except OSError as e:
                logger.warning("KV transfer %s not written: %s", path, e)
                report.failed.append(os.path.basename(path))
        if pending.saves:
            report.save_s = time.perf_counter() - t0
        return report

    def _write(self, save: TransferSave, path: str, rows: np.ndarray) -> None:
        """The rows (one write per run of consecutive rows) and their mask bytes; the header
        first when the file is new (sized now, sparse: a full disk is an OSError of a write,
        never a fault), the rename when the prompt is complete."""
        tmp = path + ".tmp"
        flags = os.O_WRONLY | (os.O_CREAT | os.O_TRUNC if save.header is not None else 0)
        fd = os.open(tmp, flags, 0o600)  # (FileNotFoundError: its request ended)
        try:
            if save.header is not None:
                _pwrite_all(fd, save.header.encode(), 0)
                os.ftruncate(fd, save.header.file_size())
            for first, pos, n in host_runs([r for r, _ in save.rows]):
                _pwrite_all(fd, rows[pos : pos + n], save.rows_offset + first * self.block_bytes)
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
