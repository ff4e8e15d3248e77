"""The KV seam, worker side: the hooks the model runner calls on each KV connector's worker
role (the scheduler side, and how the roles pair up: ``core/sched/connector.py``).

Each step the runner calls, for every role, in the engine's connector order:

1. ``before_forward(so, metadata, batch)`` after the step's request rows are updated and its
   inputs built, before the forward pass (KV-Compress: the rows' scoring flags and per-head
   slots; an offload tier: start the loads the step reads);
2. ``after_forward(so, metadata)`` after the forward pass is queued (KV-Compress: the
   evictions, whose scores include the step's attention; an offload tier or a KV transfer:
   start the saves / sends); returns the step's pending report (device tensors, no sync);
3. ``finish(pending)`` when the step resolves (its device work is done): the report, plain
   data, which reaches the scheduler role in ``ModelRunnerOutput.kv_connector_output``.

A role whose feature changes the layout of the KV cache itself (KV-Compress: a block table
per (layer, KV head)) is also the runner's KV layout (``owns_layout``): its class gives the
attention backend and the KV-cache groups before the model's caches exist, and the runner
calls the layout hooks of ``pagedllm/kv_layout.py`` on it. The plain ``KVCacheLayout``
implements those hooks as the plain paged layout does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from pagedllm.core.sched.connector import load_role

if TYPE_CHECKING:
    import torch

    from pagedllm.attention.metadata import AttentionMetadata
    from pagedllm.core.sched.output import SchedulerOutput


@dataclass
class StepBatch:
    """A step's batch as the runner built it: the rows of its requests (batch order), the
    tokens each computes, their positions [T] and metadata, and the batch indices that
    sample."""

    rows: np.ndarray
    n_sched: np.ndarray
    positions: torch.Tensor
    metadata: AttentionMetadata
    sample_idx: np.ndarray


class KVConnectorWorker:
    """The worker role of a KV connector (see the module docstring); every hook is a no-op
    here. Built by ``for_runner(runner)`` once the runner's model and layout exist."""

    name = "base"
    owns_layout = False  # True: the role is the runner's KV layout too

    @classmethod
    def for_runner(cls, runner: Any) -> KVConnectorWorker:
        """The role for one model runner (it may keep the runner's input batch and layout)."""
        return cls()

    def before_forward(self, so: SchedulerOutput, metadata: Any, batch: StepBatch) -> None:
        """Before the step's forward pass (see the module docstring)."""

    def after_forward(self, so: SchedulerOutput, metadata: Any) -> Any:
        """After the forward pass is queued; the pending report (or None)."""
        return None

    def finish(self, pending: Any) -> Any:
        """The step's report for the scheduler role, once its device work is done."""
        return pending


def worker_roles(names: tuple[str, ...]) -> list[type[KVConnectorWorker]]:
    """The worker-role classes of the engine's connectors, in order."""
    return [load_role(name, worker=True) for name in names]
