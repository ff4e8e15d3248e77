"""The multiprocess executor: one worker process per rank (``worker_proc.py``).

Each worker is started as ``python -m pagedllm.worker.worker_proc FD`` with one end of a
socket pair, over which pickled plain data travels (``Channel``). A step is three messages
to every worker - forward, sample, resolve (forward and sample are one "step" message when no
grammar bitmask is awaited) - of which only the resolve waits for a reply
(rank 0's tokens; the other ranks answer None, so their failures surface too). Handles are
integer step ids; the workers keep their launched steps by id.

No wait on a worker is unbounded: every receive wakes each ``_POLL_S`` to check that every
worker is alive (a dead one raises ``RuntimeError`` naming its rank, pid and exit code, also
while another rank, stuck in a collective with it, is the one awaited), and
start-up has a deadline (``PAGEDLLM_WORKER_START_TIMEOUT``, default 300 s). A finalizer stops
the workers if the executor is dropped without ``shutdown()``, and at interpreter exit.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedllm.config import EngineConfig
from pagedllm.core.sched.output import ModelRunnerOutput, SchedulerOutput
from pagedllm.utils.channel import Channel, encode
from pagedllm.utils.child import start_child
from pagedllm.utils.net import free_port
from pagedllm.worker.executor import WorkerGroupExecutor, plain_grammar

if TYPE_CHECKING:
    from pagedllm.structured_output.grammars import GrammarStep

_POLL_S = 1.0  # how often a waiting receive checks that its worker is alive
_PEER_EXIT_S = 0.5  # how long a rank's error waits for a dying peer to show as dead
_START_TIMEOUT_ENV = "PAGEDLLM_WORKER_START_TIMEOUT"
_DEFAULT_START_TIMEOUT_S = 300.0
_STOP_TIMEOUT_S = 10.0  # how long shutdown waits for a worker to exit before killing it


@dataclass
class _WorkerHandle:
    """The engine's side of one worker: its rank, process and channel."""

    rank: int
    proc: subprocess.Popen
    chan: Channel

    def describe(self) -> str:
        return f"worker rank {self.rank} (pid {self.proc.pid})"


def start_timeout() -> float:
    """Seconds a worker may take to build its model (``PAGEDLLM_WORKER_START_TIMEOUT``)."""
    value = os.environ.get(_START_TIMEOUT_ENV)
    if value is None:
        return _DEFAULT_START_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{_START_TIMEOUT_ENV} must be a positive number, got {value!r}")
    return seconds


def _start_worker(rank: int, device: str) -> _WorkerHandle:
    proc, chan = start_child("pagedllm.worker.worker_proc", device)
    return _WorkerHandle(rank, proc, chan)


def _stop_workers(workers: list[_WorkerHandle], timeout: float = _STOP_TIMEOUT_S) -> None:
    """Close every channel (a worker exits at the end of its input), wait, then kill."""
    for w in workers:
        try:
            w.chan.close()
        except OSError:
            pass
    deadline = time.monotonic() + timeout
    for w in workers:
        try:
            w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            w.proc.kill()
            w.proc.wait()
    workers.clear()


class MultiprocExecutor(WorkerGroupExecutor):
    """One worker process per tensor-parallel rank; rank 0's results come back (see the
    module docstring and ``Executor``)."""

    def __init__(self, config: EngineConfig, eos_token_ids: set[int] | None = None) -> None:
        world = config.parallel_config.tensor_parallel_size
        self._workers: list[_WorkerHandle] = []
        # holds the list, not self: a dropped executor is collected, then its workers stop
        self._finalizer = weakref.finalize(self, _stop_workers, self._workers)
        self._ids = itertools.count()
        self._broken: str | None = None
        try:
            for rank in range(world):
                self._workers.append(_start_worker(rank, config.device_config.device))
            # the ranks' torch.distributed store: rank 0 listens on a free local port
            init_method = f"tcp://127.0.0.1:{free_port()}" if world > 1 else ""
            for w in self._workers:
                msg = ("init", config, eos_token_ids, w.rank, world, init_method)
                self._send(w, encode(msg))
            timeout = start_timeout()
            deadline = time.monotonic() + timeout
            infos = [self._recv(w, deadline, timeout) for w in self._workers]
        except BaseException:
            self._finalizer()
            raise
        self.device_type: str = infos[0]["device_type"]
        self.max_num_reqs: int = infos[0]["max_num_reqs"]

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids, by rank (empty after shutdown)."""
        return [w.proc.pid for w in self._workers]

    # ----------------------------------------------------------------- messages
    def _check(self) -> None:
        if self._broken is not None:
            raise RuntimeError(f"the executor is broken: {self._broken}")
        if not self._workers:
            raise RuntimeError("the executor was shut down")

    def _broke(self, message: str) -> RuntimeError:
        self._broken = message.splitlines()[0]
        return RuntimeError(message)

    def _died(self, w: _WorkerHandle) -> RuntimeError:
        try:
            code = w.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # closed its end, but still running
            code = None
        return self._broke(f"{w.describe()} died (exit code {code})")

    def _send(self, w: _WorkerHandle, data: bytes) -> None:
        try:
            w.chan.send_bytes(data)
        except OSError as e:
            raise self._died(w) from e

    def _broadcast(self, msg: tuple) -> None:
        self._check()
        data = encode(msg)  # pickled once for every rank
        for w in self._workers:
            self._send(w, data)

    def _recv(self, w: _WorkerHandle, deadline: float | None = None, timeout: float = 0.0) -> Any:
        """The worker's next reply; raises, never hangs, when it died or failed."""
        while True:
            try:
                msg = w.chan.recv(timeout=_POLL_S)
            except TimeoutError:
                # any dead rank, not only the one awaited: on GPUs a rank whose peer died
                # waits in a collective (NCCL, or the all-reduce's spin on its peers'
                # signals) without failing, so it would never answer
                dead = w if w.proc.poll() is not None else self._dead_peer(w, wait_s=0.0)
                if dead is not None:
                    raise self._died(dead) from None
                if deadline is not None and time.monotonic() > deadline:
                    raise self._broke(
                        f"{w.describe()} did not start within {timeout:g} s "
                        f"(set {_START_TIMEOUT_ENV} to wait longer)"
                    ) from None
                continue
            except (EOFError, OSError) as e:
                raise self._died(w) from e
            if msg[0] == "error":
                # a rank whose peer died fails in a collective: name the dead one first. Its
                # error can arrive while the peer is still exiting (the peer's sockets close
                # before the process is reaped): look for a dead peer for up to _PEER_EXIT_S
                dead = self._dead_peer(w, wait_s=_PEER_EXIT_S)
                if dead is not None:
                    raise self._broke(
                        f"{dead.describe()} died (exit code {dead.proc.returncode}); "
                        f"{w.describe()} failed after it:\n{msg[1]}"
                    )
                raise self._broke(f"{w.describe()} failed:\n{msg[1]}")
            return msg[1]

    def _dead_peer(self, w: _WorkerHandle, wait_s: float) -> _WorkerHandle | None:
        """A worker other than ``w`` that has exited, waiting up to ``wait_s`` for one (only
        with several workers: a lone worker has no peer)."""
        others = [x for x in self._workers if x is not w]
        deadline = time.monotonic() + (wait_s if others else 0.0)
        while True:
            for other in others:
                if other.proc.poll() is not None:
                    return other
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    def _gather(self, msg: tuple) -> list[Any]:
        """Send ``msg`` to every worker; their replies, by rank."""
        self._broadcast(msg)
        return [self._recv(w) for w in self._workers]

    def _call(self, name: str, *args: Any) -> list[Any]:
        return self._gather(("call", name, args))

    # ----------------------------------------------------------------- steps
    def launch_forward(self, scheduler_output: SchedulerOutput) -> int:
        step_id = next(self._ids)
        self._broadcast(("forward", step_id, scheduler_output))
        return step_id

    def launch_sample(self, handle: int, grammar_step: GrammarStep | None) -> None:
        self._broadcast(("sample", handle, plain_grammar(grammar_step)))

    def launch_step(self, scheduler_output: SchedulerOutput) -> int:
        step_id = next(self._ids)
        self._broadcast(("step", step_id, scheduler_output))
        return step_id

    def resolve(self, handle: int) -> ModelRunnerOutput:
        return self._gather(("resolve", handle))[0]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._gather(("execute", scheduler_output))[0]

    def reset_requests(self) -> None:
        self._gather(("reset",))

    def shutdown(self) -> None:
        """Stop the workers: close their channels, wait for them, kill any that linger."""
        self._finalizer()
