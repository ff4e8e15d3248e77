"""Prefill/decode disaggregation, worker role: the copies between this rank's KV cache and
the transfer files (the bookkeeping: ``core/kv_transfer/scheduler.py``; the format:
``core/kv_transfer/files.py``).

- Loads (consumer), before the forward pass: the rows are read from the claimed file (a
  memory map of shared memory), copied into their device blocks (through pinned memory on a
  GPU), and the file is deleted.
- Saves (producer), after the forward pass: the device blocks are gathered block-major (on
  a GPU into pinned memory on a side stream), and written into the file's rows at ``finish``,
  when the step's device work is done and before its results reach the scheduler: the file
  is published (renamed from ``.tmp``) before the response that names it leaves the engine.
A write that fails (the request was aborted and its file deleted, a full disk) is reported
by name, never raised: it fails that transfer only.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedllm.core.kv_transfer.scheduler import TransferMetadata, TransferSave
from pagedllm.distributed.parallel_state import tp_info
from pagedllm.worker.kv_connector import KVConnectorWorker, StepBatch
from pagedllm.worker.offload import block_views, page_layout

logger = logging.getLogger(__name__)


@dataclass
class PendingWrites:
    """A step's saves in flight: each save with its gathered rows ``[n, block_bytes]`` (host
    memory; filled once ``event`` is done on a GPU)."""

    saves: list[tuple[TransferSave, torch.Tensor]]
    event: Any


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

    @classmethod
    def for_runner(cls, runner: Any) -> KVTransferWorker:
        return cls(runner)

    def _rows(self, path: str, offset: int, num_rows: int, mode: str) -> np.ndarray:
        """The file's rows as a memory map ``[num_rows, block_bytes]``."""
        return np.memmap(path, np.uint8, mode, offset=offset, shape=(num_rows, self.block_bytes))

    def before_forward(self, so: Any, metadata: TransferMetadata | None, batch: StepBatch) -> None:
        """Copy the step's loads into their device blocks, then delete their files."""
        if metadata is None or not metadata.loads:
            return
        tensors = self.runner.kv_layout.tensors
        for load in metadata.loads:
            path = load.path.format(rank=self.rank)
            if load.rows:
                mm = self._rows(path, load.rows_offset, load.num_rows, "r")
                rows = torch.from_numpy(np.ascontiguousarray(mm[[r for r, _ in load.rows]]))
                del mm
                if self.cuda:
                    rows = rows.pin_memory().to(self.device, non_blocking=True)
                dst = torch.tensor([d for _, d in load.rows], device=self.device)
                for dev, src in zip(tensors, block_views(self.pages, self.dtype, rows)):
                    dev.index_copy_(1, dst, src)
            try:
                os.unlink(path)
            except OSError:
                pass

    def after_forward(self, so: Any, metadata: TransferMetadata | None) -> PendingWrites | None:
        """Gather the step's saved blocks (block-major, to host memory)."""
        if metadata is None or not metadata.saves:
            return None
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
        return PendingWrites([(s, r) for s, r in gathered], event)

    def finish(self, pending: PendingWrites | None) -> list[str] | None:
        """Write the gathered rows into their files (publishing the complete ones); the names
        of the writes that failed."""
        if pending is None:
            return None
        if pending.event is not None:
            pending.event.synchronize()
        failed = []
        for save, rows in pending.saves:
            path = save.path.format(rank=self.rank)
            try:
                self._write(save, path, rows.numpy())
            except OSError as e:
                logger.warning("KV transfer %s not written: %s", path, e)
                failed.append(os.path.basename(path))
        return failed or None

    def _write(self, save: TransferSave, path: str, rows: np.ndarray) -> None:
        tmp = path + ".tmp"
        if save.header is not None:
            with open(tmp, "wb") as f:
                f.write(save.header.encode())
                f.truncate(save.header.file_size())
        elif not os.path.exists(tmp):
            raise FileNotFoundError(f"{tmp} is gone (its request ended)")
        if save.rows:
            at = [r for r, _ in save.rows]
            mm = self._rows(tmp, save.rows_offset, save.num_rows, "r+")
            mm[at] = rows
            mm.flush()
            del mm
            with open(tmp, "r+b") as f:  # the rows' mask bytes
                for r in at:
                    f.seek(save.mask_offset + r)
                    f.write(b"\x01")
        if save.final:
            os.replace(tmp, path)
