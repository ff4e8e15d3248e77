"""DPStepSync: the data-parallel engine cores agree on each step (expert parallelism).

Cores whose MoE layers exchange tokens (``distributed/expert_parallel.py``) must run their
forward passes in step: the same number, each core knowing every core's token count before
it runs. Each engine core calls ``agree`` once per loop iteration, whether it has work or not,
with the tokens it scheduled: the call returns every core's count. A step where every count
is 0 runs nowhere; otherwise every core runs it (a core with 0 tokens only joins the MoE
layers' exchanges: ``ModelRunner.execute_dp_idle``). This is vLLM's DP coordinator reduced to
one collective per step. A core with no work of its own whose last agreement had work
elsewhere (``others_busy``) agrees again at once; when no core has work, each waits for a
command at most ``idle_wait()`` (5 ms, 50 ms after a second of idleness) between
agreements, and the front end sends every core a "wake" with each request it routes, so the
others join the core that got it at once.

Dual-batch overlap (``--enable-dbo``, ``worker/ubatch.py``): each core also sends its tokens
split into two micro-batches and whether it wants the step overlapped; the step is, on
every core, only if no core with tokens said no.

Stopping: a core leaving (shutdown) says so in its last ``agree``; every core then stops
joining collectives (``stopped``), so none waits on a core that is gone.

The collective is a gloo all-reduce on a group of its own (a ``TCPStore`` on the first core's
port), on the CPU whatever the device: it decides what the device does next.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

import torch

# how long a core waits for a command before agreeing again when no core has work: short
# right after work, longer once everything has been idle a while (the front end also wakes
# every core when it sends one a request, so this bounds only a missed wake)
IDLE_POLL_S = 0.005
IDLE_POLL_LONG_S = 0.05
IDLE_AFTER_S = 1.0
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
        self.num_idle_steps = 0  # steps this core joined with no tokens of its own
        self.num_overlapped_steps = 0  # steps run as two micro-batches (dual-batch overlap)
        self.others_busy = False  # the last agreement had work on another core
        self._last_work = time.monotonic()  # when an agreement last had work anywhere

    def idle_wait(self) -> float:
        """How long to wait for a command before the next agreement when this core has no
        work (0 while another core has: its step must not wait for this one)."""
        if self.others_busy:
            return 0.0
        idle = time.monotonic() - self._last_work
        return IDLE_POLL_S if idle < IDLE_AFTER_S else IDLE_POLL_LONG_S

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
        if vec[2 * n + 1] > 0:
            self.stopped = True
            return Agreement([0] * n, None)
        a, b = vec[:n].tolist(), vec[n : 2 * n].tolist()
        counts = [x + y for x, y in zip(a, b)]
        self.others_busy = any(c for i, c in enumerate(counts) if i != self.rank)
        if any(counts):
            self._last_work = time.monotonic()
        if sum(split) == 0 and any(counts):
            self.num_idle_steps += 1
        if vec[2 * n] == 0 and any(counts):
            self.num_overlapped_steps += 1
            return Agreement(counts, (a, b))
        return Agreement(counts, None)
