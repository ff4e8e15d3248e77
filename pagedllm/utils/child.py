"""Start a Python child process of this package that talks over an inherited socket pair.

Used for the engine core process (``engine/core_proc.py``) and the model workers of the
multiprocess executor (``worker/worker_proc.py``): ``python -m MODULE FD``, FD being the
child's end of a ``socket.socketpair()``, so nothing of the parent's ``__main__`` is imported
again (as with multiprocessing's spawn) and no port is opened.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys

from pagedllm.utils.channel import Channel

_PR_SET_PDEATHSIG = 1


def start_child(
    module: str,
    device: str,
    extra_fds: tuple[int, ...] = (),
    passive_omp: bool = True,
    env_extra: dict[str, str] | None = None,
) -> tuple[subprocess.Popen, Channel]:
    """Run ``python -m module FD [EXTRA_FD ...]``; the process and our end of its channel.
    ``extra_fds`` are inherited by the child and named after FD on its command line;
    ``env_extra``: variables set in the child's environment only.
    ``passive_omp``: on a CPU, OpenMP threads sleep after each parallel region (see below);
    off for a process whose own loop runs the forward passes (the engine core)."""
    ours, theirs = socket.socketpair()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env.update(env_extra or {})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    if device == "cpu" and passive_omp:
        # The child's forward passes and other processes' loops take turns on the same
        # cores: OpenMP threads spinning after each parallel region would hold the core
        # another loop needs to wake on, and on a host with few cores every step would wait
        # for them (benchmarks/serving_cpu_vs_vllm.py with OMP_WAIT_POLICY=ACTIVE against the
        # default measures it). Unless the user chose.
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    fds = (theirs.fileno(), *extra_fds)
    cmd = [sys.executable, "-m", module, *map(str, fds)]
    try:
        proc = subprocess.Popen(cmd, pass_fds=fds, env=env, stdin=subprocess.DEVNULL)
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    return proc, Channel(ours)


def child_channel(argv: list[str], death_signal: int = signal.SIGTERM) -> Channel:
    """In the child: the channel on the inherited socket ``argv[1]``. Ctrl-C reaches the whole
    process group: the parent handles it and closes the channel, which ends the child (a
    KeyboardInterrupt here would only print a traceback). If the parent dies without closing
    it (killed), the kernel sends this process ``death_signal`` (Linux), so no child outlives
    it."""
    fd = int(argv[1])
    os.set_inheritable(fd, False)  # not to processes this one starts
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(death_signal)
    return Channel(socket.socket(fileno=fd))


def die_with_parent(death_signal: int = signal.SIGTERM) -> None:
    """Ask Linux to send ``death_signal`` to this process when its parent exits (a no-op
    elsewhere).
    The socket's end-of-file is the normal signal; this covers a child busy in native code."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, death_signal)
    except (OSError, AttributeError):  # pragma: no cover - unusual libc
        return
    if os.getppid() == 1:  # the parent was already gone before prctl took effect
        os.kill(os.getpid(), death_signal)


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (Linux ``/proc``; a zombie, dead but not yet reaped, does not).
    True where there is no ``/proc`` to ask."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        return True


def stop_process(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM ``proc``, wait up to ``timeout`` seconds for it to exit, then SIGKILL it."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float) -> bool:
    """Poll ``url``/health until it answers 200 (True), or until ``proc`` exits or
    ``timeout`` seconds pass (False): a started server or proxy is ready to serve."""
    import time
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    return False
