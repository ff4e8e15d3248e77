"""DPStepSync: the data-parallel engine cores agree on each step (expert parallelism).

Cores whose MoE layers exchange tokens (``distributed/expert_parallel.py``) must run their
forward passes in step: the same number, each core knowing every core's token count before
it runs. Each engine core calls ``agree`` once per loop iteration, whether it has work or not,
with the tokens it scheduled: the call returns every core's count. A step where every count
is 0 runs nowhere; otherwise every core runs it (a core with 0 tokens only joins the MoE
layers' exchanges: ``ModelRunner.execute_dp_idle``). This is vLLM's DP coordinator reduced to
one collective per step: an idle core polls its front end with a short timeout
(``IDLE_POLL_S``), so a request reaching any core starts the others within that time.

Dual-batch overlap (``--enable-dbo``, ``worker/ubatch.py``): each core also sends its tokens
split into two micro-batches and whether it wants the step overlapped; the step is, on
every core, only if no core with tokens said no.

Stopping: a core leaving (shutdown) says so in its last ``agree``; every core then stops
joining collectives (``stopped``), so none waits on a core that is gone.

The collective is a gloo all-reduce on a group of its own (a ``TCPStore`` on the first core's
port), on the CPU whatever the device: it decides what the device does next.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch

IDLE_POLL_S = 0.005  # how long an idle core waits for a command before agreeing again
TIMEOUT_S = 120


@dataclass
class Agreement:
    """What the cores agreed on for one step: each core's tokens, and with dual-batch
    overlap each core's tokens in micro-batches a and b (None: one batch)."""

    counts: list[int]
    ubatches: tuple[list[int], list[int]] | None


class DPStepSync:
    """One engine core's end of the step agreement (see the module docstring)."""

    def __init__(self, rank: int, size: int, host: str, port: int) -> None:
        import torch.distributed as dist

        self.rank, self.size = rank, size
        timeout = timedelta(seconds=TIMEOUT_S)
        store = dist.TCPStore(host, port, size, rank == 0, timeout=timeout)
        self.group = dist.ProcessGroupGloo(dist.PrefixStore("dp_step", store), rank, size, timeout)
        self._store = store  # (kept alive: the group talks through it)
        self.stopped = False
        self.num_agreed = 0  # agreements so far
        self.num_idle_steps = 0  # steps this core joined with no tokens of its own
        self.num_overlapped_steps = 0  # steps run as two micro-batches (dual-batch overlap)

    def agree(
        self, split: tuple[int, int], overlap: bool = False, stopping: bool = False
    ) -> Agreement:
        """Every core's tokens of the step, from this core's ``split`` (its tokens in
        micro-batches a and b, ``worker/ubatch.py``; (n, 0) without dual-batch overlap) and
        whether it wants the step ``overlap``-ped; a core with tokens that does not want it
        vetoes it. After a core said ``stopping`` (this one or another): ``stopped``, and
        no tokens anywhere.

        Example (3 cores, no overlap): core 1 sends a [0, 5, 0], b [0, 0, 0], veto 1, stop
        0; the sum is a [2, 5, 0], ...: core 2 joins a step of 5 rows from core 1 and 2
        from core 0."""
        n = self.size
        if self.stopped:
            return Agreement([0] * n, None)
        vec = torch.zeros(2 * n + 2, dtype=torch.int64)  # [a..., b..., vetoes, stopping]
        vec[self.rank], vec[n + self.rank] = split
        vec[2 * n] = int(sum(split) > 0 and not overlap)
        vec[2 * n + 1] = int(stopping)
        self.group.allreduce([vec]).wait()
        self.num_agreed += 1
        if vec[2 * n + 1] > 0:
            self.stopped = True
            return Agreement([0] * n, None)
        a, b = vec[:n].tolist(), vec[n : 2 * n].tolist()
        counts = [x + y for x, y in zip(a, b)]
        if sum(split) == 0 and any(counts):
            self.num_idle_steps += 1
        if vec[2 * n] == 0 and any(counts):
            self.num_overlapped_steps += 1
            return Agreement(counts, (a, b))
        return Agreement(counts, None)
