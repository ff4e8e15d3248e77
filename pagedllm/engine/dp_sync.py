"""DPStepSync: the data-parallel engine cores agree on each step (expert parallelism).

Cores whose MoE layers exchange tokens (``distributed/expert_parallel.py``) must run their
forward passes in step: the same number, each core knowing every core's token count before
it runs. Each engine core calls ``agree`` once per loop iteration, whether it has work or not,
with the tokens it scheduled: the call returns every core's count. A step where every count
is 0 runs nowhere; otherwise every core runs it (a core with 0 tokens only joins the MoE
layers' exchanges: ``ModelRunner.execute_dp_idle``). This is vLLM's DP coordinator reduced to
one collective per step: an idle core polls its front end with a short timeout
(``IDLE_POLL_S``), so a request reaching any core starts the others within that time.

Stopping: a core leaving (shutdown) says so in its last ``agree``; every core then stops
joining collectives (``stopped``), so none waits on a core that is gone.

The collective is a gloo all-reduce on a group of its own (a ``TCPStore`` on the first core's
port), on the CPU whatever the device: it decides what the device does next.
"""

from __future__ import annotations

from datetime import timedelta

import torch

IDLE_POLL_S = 0.005  # how long an idle core waits for a command before agreeing again
TIMEOUT_S = 120


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

    def agree(self, num_tokens: int, stopping: bool = False) -> list[int]:
        """Every core's token count of the step (``num_tokens`` is this core's); after a
        core said ``stopping`` (this one or another), ``stopped`` and no counts ([0, ...]).

        Example (3 cores): core 1 sends [0, 5, 0 | 0], the others theirs; the sum is
        [2, 5, 0 | 0]: core 2 joins a step of 5 rows from core 1 and 2 from core 0."""
        if self.stopped:
            return [0] * self.size
        vec = torch.zeros(self.size + 1, dtype=torch.int64)  # [counts..., stopping]
        vec[self.rank] = num_tokens
        vec[self.size] = int(stopping)
        self.group.allreduce([vec]).wait()
        self.num_agreed += 1
        if vec[self.size] > 0:
            self.stopped = True
            return [0] * self.size
        counts = vec[: self.size].tolist()
        if num_tokens == 0 and any(counts):
            self.num_idle_steps += 1
        return counts
