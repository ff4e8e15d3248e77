"""The front end's handle on an engine core process (``engine/core_proc.py``): start it, wait
until its model is built, stop it, and never leave it behind."""

from __future__ import annotations

import logging
import socket
import subprocess
import time
import weakref
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.utils.channel import Channel
from pagedllm.utils.child import process_alive, start_child
from pagedllm.worker.multiproc_executor import start_timeout

logger = logging.getLogger(__name__)

_POLL_S = 1.0  # how often a start-up wait checks that the process is alive
_STOP_TIMEOUT_S = 10.0


def _stop(proc: subprocess.Popen, chan: Channel, timeout: float) -> None:
    """Ask the process to stop, close the channel (it exits at end of file too), wait, kill."""
    if proc.poll() is None:
        try:
            chan.send(("shutdown",))
        except OSError:
            pass
    try:
        chan.close()
    except OSError:
        pass
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        logger.warning("engine core process %d did not stop in %.0f s: killed", proc.pid, timeout)
        proc.kill()
        proc.wait()


class EngineCoreClient:
    """Starts ``python -m pagedllm.engine.core_proc`` and sends it the config; returns once the
    core reports ready (``info``: pid, num_blocks, token_capacity, max_num_seqs, stats,
    build_seconds; with ``wait=False`` at once, and ``wait_ready()`` waits), raising
    RuntimeError with the child's traceback if it failed, died or took longer than
    ``PAGEDLLM_WORKER_START_TIMEOUT`` (300 s). A finalizer stops the process
    if this object is dropped without ``shutdown()``, and at interpreter exit."""

    def __init__(
        self,
        config: EngineConfig,
        eos_token_id: int | None,
        num_front_ends: int = 1,
        env: dict[str, str] | None = None,
        wait: bool = True,
    ) -> None:
        t0 = time.monotonic()
        # the channels of the other front ends (API server processes): their ends stay here
        # until handed to those processes (``extra_channels``)
        pairs = [socket.socketpair() for _ in range(num_front_ends - 1)]
        self.extra_channels = [Channel(ours) for ours, _ in pairs]
        try:
            self.proc, self.chan = start_child(
                "pagedllm.engine.core_proc",
                config.device_config.device,
                tuple(theirs.fileno() for _, theirs in pairs),
                # its own loop runs the forward passes: OpenMP threads that spin between the
                # ops of a step, rather than sleep, start each op sooner
                passive_omp=False,
                env_extra=env,
            )
        finally:
            for _, theirs in pairs:
                theirs.close()
        self._finalizer = weakref.finalize(self, _stop, self.proc, self.chan, _STOP_TIMEOUT_S)
        self._t0 = t0
        self.info: dict[str, Any] = {}
        try:
            self.chan.send(("init", config, eos_token_id))
        except BaseException:
            self._finalizer()
            raise
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Wait for the core's "ready" (``info``); ``wait=False`` at construction leaves this
        to the caller (several cores start at once; they may wait for each other)."""
        try:
            self.info = self._wait_ready(start_timeout())
        except BaseException:
            self._finalizer()
            raise
        self.startup_seconds = time.monotonic() - self._t0

    def _wait_ready(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = self.chan.recv(timeout=_POLL_S)
            except TimeoutError:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"the engine core process exited during start-up "
                        f"(exit code {self.proc.returncode})"
                    ) from None
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the engine core process did not start within {timeout:g} s"
                    ) from None
                continue
            except (EOFError, OSError) as e:
                self.proc.wait()
                raise RuntimeError(
                    f"the engine core process exited during start-up "
                    f"(exit code {self.proc.returncode})"
                ) from e
            if msg[0] == "failed":
                raise RuntimeError(f"the engine core failed to start:\n{msg[1]}")
            assert msg[0] == "ready", msg[0]
            return msg[1]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def exit_code(self) -> int | None:
        """The process's exit code, or None while it runs."""
        return self.proc.poll()

    def wait_exit(self, timeout: float) -> int | None:
        """The exit code once the process has exited (None if it still runs after
        ``timeout`` s)."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def shutdown(self, timeout: float = _STOP_TIMEOUT_S) -> None:
        """Stop the process (waits up to ``timeout`` s, then kills it); idempotent."""
        if self._finalizer.detach() is not None:
            _stop(self.proc, self.chan, timeout)


class AttachedCore:
    """An API server's handle on an engine core that another process started
    (``--api-server-count``): the same interface as ``EngineCoreClient`` on a channel it was
    given; stopping it only closes that channel (the core then exits, and so does every
    other front end)."""

    def __init__(self, chan: Channel, info: dict[str, Any]) -> None:
        self.chan = chan
        self.info = info
        self.startup_seconds = 0.0
        self.extra_channels: list[Channel] = []

    @property
    def pid(self) -> int:
        return self.info["pid"]

    def exit_code(self) -> int | None:
        """None while the core process runs; -1 once it is gone (its code is its parent's)."""
        return None if process_alive(self.pid) else -1

    def wait_exit(self, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while self.exit_code() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.exit_code()

    def shutdown(self, timeout: float = _STOP_TIMEOUT_S) -> None:
        try:
            self.chan.close()
        except OSError:
            pass
