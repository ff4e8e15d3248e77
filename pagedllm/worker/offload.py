"""The host KV tier (``kv_offloading_size``), worker role: the host copies of KV blocks and the
copies between them and the device cache (the bookkeeping: ``core/sched/offload.py``).

Host memory on a GPU: one pinned byte tensor ``[num_host_blocks, block_bytes]``, block-major:
host block h holds, one after another, the K and V pages of one block id in every device cache
tensor (``[2, *page]`` each). A block is one contiguous run of bytes (1.8 MiB for Qwen3-0.6B),
so a copy over PCIe moves a block, or a run of consecutive blocks, in one transfer, where a
layer-major host copy would move one 32 KiB page per layer and K/V. On a CPU there is no bus
to cross: the host tensors have the device cache's own layout (one ``[2, num_host_blocks,
*page]`` per cache tensor), whose gathers copy contiguous pages (a block-major buffer's
views are strided, and gathering through them made the tier's loads slower on a CPU).

- Loads, before the forward pass: the host blocks are copied into a device staging buffer
  (one asynchronous copy per run of consecutive host ids, on the compute stream: no host
  sync), then scattered into every cache tensor's device blocks in one launch
  (``ops/block_rows.py``), which the forward pass reads.
- Saves, after the forward pass: the device blocks are gathered into a staging buffer (one
  launch) on the compute stream (after the forward wrote them; a later step's writes come
  after the gather), then copied straight into their host blocks on a side stream,
  overlapping the next steps; ``finish`` (when the step resolves) waits for that copy
  before the scheduler counts the entries as loadable.
On a CPU the copies are ``index_select`` / ``index_copy_`` calls made at once.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedllm.core.kv_transfer.files import row_bytes
from pagedllm.core.sched.offload import OffloadMetadata, OffloadReport
from pagedllm.kv_layout import copy_dtype
from pagedllm.ops.kv_rows import move_block_rows
from pagedllm.utils.pinned import PinnedRing
from pagedllm.worker.head_rows import HeadRows
from pagedllm.worker.kv_connector import KVConnectorWorker, StepBatch


@dataclass
class PendingSaves:
    """A step's saves in flight: the side stream's event after the copies (None on a CPU or
    with nothing to save: already done) and the step's report."""

    event: Any
    report: OffloadReport


def host_runs(host_ids: list[int]) -> list[tuple[int, int, int]]:
    """(first host id, first position, length) of each run of consecutive host ids.

    Example: [7, 8, 9, 3, 4] -> [(7, 0, 3), (3, 3, 2)]: two copies instead of five."""
    runs: list[tuple[int, int, int]] = []
    for i, h in enumerate(host_ids):
        if runs and runs[-1][0] + runs[-1][2] == h:
            first, pos, n = runs[-1]
            runs[-1] = (first, pos, n + 1)
        else:
            runs.append((h, i, 1))
    return runs


def page_layout(kv_groups: Any, dtype: torch.dtype) -> tuple[list[tuple[int, tuple]], int]:
    """(byte offset, page shape) of each cache tensor's ``[2, *page]`` in a block-major
    block, and the block's bytes. Example: two layers of [16, 8, 128] bf16 pages -> [(0, ...),
    (65536, ...)], 131072."""
    elem = torch.empty(0, dtype=dtype).element_size()
    pages, offset = [], 0
    for spec in kv_groups.tensor_specs():
        pages.append((offset, tuple(spec.page_shape)))
        offset += 2 * math.prod(spec.page_shape) * elem
    return pages, offset


class OffloadWorker(KVConnectorWorker):
    """Copies between the device KV cache and its host tier (see the module docstring)."""

    name = "offload"

    def __init__(self, runner: Any, num_host_blocks: int) -> None:
        self.runner = runner
        self.num_host_blocks = num_host_blocks
        self.device: torch.device = runner.device
        self.cuda = self.device.type == "cuda"
        # block ids to the device without waiting for it (a pageable copy would)
        self.ids = PinnedRing(self.device, 1024)
        self.dtype: torch.dtype = copy_dtype(runner.kv_dtype)  # uint8 for an fp8 cache
        # (byte offset, page shape) of each cache tensor's [2, *page] in a host block
        self.pages: list[tuple[int, tuple[int, ...]]] = []
        self.block_bytes = 0
        self.host = torch.empty(0, dtype=torch.uint8)  # [num_host_blocks, block_bytes]
        self.host_tensors: list[torch.Tensor] = []  # CPU: [2, num_host_blocks, *page] each
        self.side = torch.cuda.Stream(self.device) if self.cuda else None
        self._load_s = 0.0  # host time of the loads of the step being launched
        self.per_head = False  # KV-Compress: its per-head blocks move as rows (``head_rows``)
        self._head_rows: HeadRows | None = None

    @property
    def head_rows(self) -> HeadRows:
        """The rows over the runner's per-head cache (made at first use: the cache comes
        after the connectors)."""
        if self._head_rows is None:
            self._head_rows = HeadRows(self.runner.kv_layout, self.ids)
        return self._head_rows

    @classmethod
    def for_runner(cls, runner: Any) -> OffloadWorker:
        """The role with its host memory allocated now, at start-up (pinning GiBs takes
        seconds: not in a request's first step), laid out for the device cache's tensors."""
        groups = runner.kv_groups
        if groups.head_paged is not None:  # KV-Compress: a host block is a row of every head
            block = row_bytes(groups)
            role = cls(runner, runner.cache_config.kv_offloading_bytes // block)
            role.block_bytes, role.per_head = block, True
            role.host = torch.empty(
                role.num_host_blocks, block, dtype=torch.uint8, pin_memory=role.cuda
            )
            return role
        role = cls(runner, runner.cache_config.kv_offloading_bytes // groups.block_bytes)
        role.pages, role.block_bytes = page_layout(groups, role.dtype)
        if role.cuda:
            role.host = torch.empty(
                role.num_host_blocks, role.block_bytes, dtype=torch.uint8, pin_memory=True
            )
        else:  # no bus to cross: the device cache's own layout, contiguous gathers
            role.host_tensors = [
                torch.zeros(2, role.num_host_blocks, *page, dtype=role.dtype)
                for _, page in role.pages
            ]
        return role

    def before_forward(self, so: Any, metadata: OffloadMetadata | None, batch: StepBatch) -> None:
        """Copy the step's loads into their device blocks (before the forward pass reads
        them)."""
        if metadata is None or not metadata.loads:
            return
        t0 = time.perf_counter()
        host_ids = [h for h, _ in metadata.loads]
        if self.per_head:
            self.head_rows.scatter(
                self._host_rows(host_ids), np.stack(metadata.load_heads),
                np.fromiter((i for _, i in metadata.loads), np.int64),
            )  # fmt: skip
            self._load_s = time.perf_counter() - t0
            return
        dst = self.ids.ship(np.fromiter((d for _, d in metadata.loads), np.int64))
        tensors = self.runner.kv_layout.copy_tensors
        if self.cuda:  # every layer's blocks in one launch
            move_block_rows(tensors, dst, self._host_rows(host_ids), to_rows=False)
        else:
            src = torch.tensor(host_ids)
            for dev, host in zip(tensors, self.host_tensors):
                dev.index_copy_(1, dst, host.index_select(1, src))
        self._load_s = time.perf_counter() - t0

    def _host_rows(self, host_ids: list[int]) -> torch.Tensor:
        """[n, block_bytes] host blocks ``host_ids`` on the device (one asynchronous copy per
        run of consecutive ids on a GPU, on the compute stream: no host sync; a gather on a
        CPU, whose block-major host tensor only KV-Compress's rows use)."""
        if not self.cuda:
            return self.host.index_select(0, torch.tensor(host_ids))
        staged = torch.empty(len(host_ids), self.block_bytes, dtype=torch.uint8, device=self.device)
        for first, pos, n in host_runs(host_ids):
            staged[pos : pos + n].copy_(self.host[first : first + n], non_blocking=True)
        return staged

    def _gathered(self, metadata: OffloadMetadata) -> torch.Tensor:
        """[n, block_bytes] the step's saved blocks on the device, block-major (queued on the
        compute stream, after the forward pass that wrote them)."""
        staged = torch.empty(
            len(metadata.saves), self.block_bytes, dtype=torch.uint8, device=self.device
        )
        if self.per_head:
            self.head_rows.gather(np.stack(metadata.save_heads), staged)
            return staged
        src = self.ids.ship(np.fromiter((d for d, _ in metadata.saves), np.int64))
        move_block_rows(self.runner.kv_layout.copy_tensors, src, staged, to_rows=True)
        return staged

    def after_forward(self, so: Any, metadata: OffloadMetadata | None) -> PendingSaves | None:
        """Start the step's saves (see the module docstring); the pending report."""
        if metadata is None:
            return None
        report = OffloadReport(host_s=self._load_s)
        self._load_s = 0.0
        event = None
        if metadata.saves:
            t0 = time.perf_counter()
            host_ids = [h for _, h in metadata.saves]
            if self.cuda:
                assert self.side is not None
                staged = self._gathered(metadata)
                self.side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self.side):
                    staged.record_stream(self.side)
                    for first, pos, n in host_runs(host_ids):
                        self.host[first : first + n].copy_(staged[pos : pos + n], non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(self.side)
            elif self.per_head:
                self.host.index_copy_(0, torch.tensor(host_ids), self._gathered(metadata))
            else:
                src = torch.tensor([d for d, _ in metadata.saves])
                dst = torch.tensor(host_ids)
                for dev, host in zip(self.runner.kv_layout.copy_tensors, self.host_tensors):
                    host.index_copy_(1, dst, dev.index_select(1, src))
            report.host_s += time.perf_counter() - t0
        return PendingSaves(event, report)

    def finish(self, pending: PendingSaves | None) -> OffloadReport | None:
        """Wait for the step's saves to reach their host blocks; the report."""
        if pending is None:
            return None
        if pending.event is not None:
            t0 = time.perf_counter()
            pending.event.synchronize()
            pending.report.host_s += time.perf_counter() - t0
        return pending.report
