"""The host KV tier (``kv_offloading_size``), worker role: the host copies of KV blocks and the
copies between them and the device cache (the bookkeeping: ``core/sched/offload.py``).

Host memory: one tensor per device cache tensor, ``[2, num_host_blocks, *page]`` (pinned on
a GPU), so that host block h of every tensor holds what device block d of the same tensor held.

- Loads, before the forward pass: the host blocks are gathered on the host (into pinned
  memory on a GPU), copied to the device without a host sync, and scattered into their
  device blocks on the compute stream, which the forward pass then reads.
- Saves, after the forward pass: the device blocks are gathered on the compute stream (after
  the forward wrote them; a later step's writes come after the gather), then copied to pinned
  host memory on a side stream, overlapping the next steps; the copy is waited for and
  scattered into the host blocks when the step resolves (``finish``), before the scheduler
  counts the entries as loadable.
On a CPU the copies are plain ``index_copy_`` calls made at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.core.sched.offload import OffloadMetadata, OffloadReport
from pagedllm.worker.kv_connector import KVConnectorWorker, StepBatch


@dataclass
class PendingSaves:
    """A step's saves in flight: host block ids, one pinned buffer per cache tensor, the side
    stream's event after the copies (None on a CPU: already done)."""

    host_ids: torch.Tensor
    buffers: list[torch.Tensor]
    event: Any
    report: OffloadReport


class OffloadWorker(KVConnectorWorker):
    """Copies between the device KV cache and its host tier (see the module docstring)."""

    name = "offload"

    def __init__(self, runner: Any, num_host_blocks: int) -> None:
        self.runner = runner
        self.num_host_blocks = num_host_blocks
        self.device: torch.device = runner.device
        self.cuda = self.device.type == "cuda"
        self.host: list[torch.Tensor] = []
        self.side = torch.cuda.Stream(self.device) if self.cuda else None
        self._load_s = 0.0  # host time of the loads of the step being launched

    @classmethod
    def for_runner(cls, runner: Any) -> OffloadWorker:
        """The role with its host tensors allocated now, at start-up (pinning GiBs takes
        seconds: not in a request's first step), shaped as the device cache's will be."""
        groups = runner.kv_groups
        role = cls(runner, runner.cache_config.kv_offloading_bytes // groups.block_bytes)
        dtype = runner.model_config.torch_dtype
        role.host = [
            torch.zeros(
                2, role.num_host_blocks, *spec.page_shape, dtype=dtype, pin_memory=role.cuda
            )
            for spec in groups.tensor_specs()
        ]
        return role

    def before_forward(self, so: Any, metadata: OffloadMetadata | None, batch: StepBatch) -> None:
        """Copy the step's loads into their device blocks (before the forward pass reads
        them)."""
        if metadata is None or not metadata.loads:
            return
        t0 = time.perf_counter()
        src = torch.tensor([h for h, _ in metadata.loads])
        dst = torch.tensor([d for _, d in metadata.loads], device=self.device)
        for dev, host in zip(self.runner.kv_layout.tensors, self.host):
            if self.cuda:
                staged = torch.empty(
                    (host.shape[0], len(src), *host.shape[2:]), dtype=host.dtype, pin_memory=True
                )
                torch.index_select(host, 1, src, out=staged)
                dev.index_copy_(1, dst, staged.to(self.device, non_blocking=True))
            else:
                dev.index_copy_(1, dst, host.index_select(1, src))
        self._load_s = time.perf_counter() - t0

    def after_forward(self, so: Any, metadata: OffloadMetadata | None) -> PendingSaves | None:
        """Start the step's saves (see the module docstring); the pending report."""
        if metadata is None:
            return None
        report = OffloadReport(host_s=self._load_s)
        self._load_s = 0.0
        host_ids = torch.tensor([h for _, h in metadata.saves], dtype=torch.long)
        buffers: list[torch.Tensor] = []
        event = None
        if metadata.saves:
            t0 = time.perf_counter()
            src = torch.tensor([d for d, _ in metadata.saves], device=self.device)
            gathered = [t.index_select(1, src) for t in self.runner.kv_layout.tensors]
            if self.cuda:
                assert self.side is not None
                self.side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self.side):
                    for g in gathered:
                        g.record_stream(self.side)
                        buf = torch.empty(g.shape, dtype=g.dtype, pin_memory=True)
                        buf.copy_(g, non_blocking=True)
                        buffers.append(buf)
                    event = torch.cuda.Event()
                    event.record(self.side)
            else:
                buffers = gathered
            report.host_s += time.perf_counter() - t0
        return PendingSaves(host_ids, buffers, event, report)

    def finish(self, pending: PendingSaves | None) -> OffloadReport | None:
        """Wait for the step's saves to reach pinned memory and put them in their host
        blocks; the report."""
        if pending is None:
            return None
        if pending.buffers:
            t0 = time.perf_counter()
            if pending.event is not None:
                pending.event.synchronize()
            for host, buf in zip(self.host, pending.buffers):
                host.index_copy_(1, pending.host_ids, buf)
            pending.report.host_s += time.perf_counter() - t0
        return pending.report
