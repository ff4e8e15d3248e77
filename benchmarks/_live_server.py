"""A live ``pagedllm serve`` for the scripts that test the server from outside (``soak.py``,
``huge_prompt.py``): start one on loopback (or attach to one by URL), wait until it is healthy,
read its ``/metrics`` gauges, measure its memory, stop it.

Memory is the resident set (``VmRSS`` in ``/proc/PID/status``) of the server process and all its
descendants (the engine core process, a grammar worker, multiprocessing helpers), summed: pages
shared between them count once per process, which is fine for the growth these scripts bound.
Only a server this module started has a known pid; with ``--url`` the memory is not measured.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                kids += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return kids


def _rss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return 0  # a zombie has no VmRSS line


def tree_rss(pid: int) -> dict[int, int]:
    """{pid: resident bytes} of ``pid`` and every descendant still alive."""
    out: dict[int, int] = {}
    todo = [pid]
    while todo:
        p = todo.pop()
        kib = _rss_kib(p)
        if kib is None:
            continue
        out[p] = kib * 1024
        todo += _children(p)
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads), 0.0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_rss_bytes(pid: int) -> int:
    """Resident bytes of ``pid`` and its descendants, summed."""
    return sum(tree_rss(pid).values())


class RssSampler:
    """Samples ``tree_rss_bytes(pid)`` every ``period_s`` on a thread: ``peak`` and a timeline
    of (seconds since start, bytes)."""

    def __init__(self, pid: int, period_s: float = 0.05) -> None:
        self.pid, self.period_s = pid, period_s
        self.t0 = time.monotonic()
        self.samples: list[tuple[float, int]] = []
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            rss = tree_rss_bytes(self.pid)
            self.samples.append((time.monotonic() - self.t0, rss))
            self.peak = max(self.peak, rss)
            self._stop.wait(self.period_s)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def device_label(device: str | None) -> str:
    """``"cpu"``, or the GPU's name with spaces as underscores (``NVIDIA_H100_80GB_HBM3``), for
    result file names. Asks ``nvidia-smi``: importing torch here would put a CUDA context on
    the GPU the server uses."""
    if device == "cpu" or shutil.which("nvidia-smi") is None:
        return "cpu"
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "cpu"
    return re.sub(r"\s+", "_", out) or "cpu"


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {series name without labels: value summed over label sets}, plus
    ``name{labels}`` for series with labels other than ``model_name`` (e.g.
    ``vllm:request_success_total{finished_reason="abort"}``)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name, _, labels = name_labels.partition("{")
        try:
            v = float(value)
        except ValueError:
            continue
        out[name] = out.get(name, 0.0) + v
        other = [x for x in labels.rstrip("}").split(",") if x and not x.startswith("model_name=")]
        if other and not name.endswith("_bucket"):
            out[f"{name}{{{','.join(other)}}}"] = v
    return out


def flag_value(argv: list[str], name: str) -> str | None:
    """The value of flag ``name`` in ``argv`` (``--flag=value`` or ``--flag value``)."""
    for i, a in enumerate(argv):
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
    return None


def git_state() -> dict[str, Any]:
    """The commit this tree is at, and whether files under ``pagedllm/`` differ from it."""

    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout

    dirty = [line[3:] for line in git("status", "--porcelain", "pagedllm").splitlines()]
    return {"commit": git("rev-parse", "HEAD").strip(), "pagedllm_uncommitted": dirty}


class LiveServer:
    """A ``pagedllm serve`` on 127.0.0.1 started by this process (``pid`` known), or one at a
    URL it attaches to (``pid`` None). Use as a context manager: the started server gets
    SIGTERM on exit (SIGKILL if it does not stop within ``stop_timeout_s``)."""

    def __init__(
        self,
        url: str | None = None,
        model: str | None = None,
        server_args: list[str] | None = None,
        log_path: str | None = None,
        start_timeout_s: float = 600.0,
        stop_timeout_s: float = 60.0,
        env: dict[str, str] | None = None,
    ) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.stop_timeout_s = stop_timeout_s
        self.exit_code: int | None = None
        if url is not None:
            self.url = url.rstrip("/")
            self.cmd: list[str] | None = None
            self.log_path: str | None = None
            self.startup_s = 0.0
            self.wait_healthy(start_timeout_s)
            return
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve"]
        if model:
            self.cmd.append(model)
        self.cmd += [
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--uvicorn-log-level",
            "warning",
            *(server_args or []),
        ]
        self.log_path = log_path or tempfile.mkstemp(prefix="pagedllm_serve_", suffix=".log")[1]
        full_env = {**os.environ, **(env or {})}
        full_env["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT), *filter(None, [full_env.get("PYTHONPATH")])]
        )
        print(f"starting: {shlex.join(self.cmd)}  (log {self.log_path})", flush=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
            )
        t0 = time.monotonic()
        try:
            self.wait_healthy(start_timeout_s)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0

    @property
    def pid(self) -> int | None:
        """The server process's pid (None when attached by URL)."""
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        """False once a server this object started has exited."""
        return self.proc is None or self.proc.poll() is None

    def get(self, path: str, timeout: float = 10.0) -> tuple[int, bytes]:
        """(status, body) of ``GET path`` (urllib, blocking)."""
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def wait_healthy(self, timeout_s: float) -> None:
        """Block until ``GET /health`` answers 200 (RuntimeError if the process exits first or
        ``timeout_s`` passes)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(
                    f"the server exited with {self.proc.returncode} during "  # type: ignore[union-attr]
                    f"start-up; see {self.log_path}"
                )
            try:
                if self.get("/health", timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"the server at {self.url} was not healthy within {timeout_s:g} s")

    def metrics(self) -> dict[str, float]:
        """``GET /metrics``, parsed (``parse_metrics``)."""
        status, body = self.get("/metrics")
        if status != 200:
            raise RuntimeError(f"/metrics answered {status}")
        return parse_metrics(body.decode())

    def model_name(self) -> str:
        """The served model's name (``/v1/models``)."""
        status, body = self.get("/v1/models")
        if status != 200:
            raise RuntimeError(f"/v1/models answered {status}: {body[:200]!r}")
        return json.loads(body)["data"][0]["id"]

    def rss_bytes(self) -> int | None:
        """Resident bytes of the server and its children (None when attached by URL)."""
        return tree_rss_bytes(self.pid) if self.pid is not None else None

    def rss_by_process(self) -> dict[str, int]:
        """{"name[pid]": resident bytes} of the server's process tree ({} when attached)."""
        if self.pid is None:
            return {}
        out = {}
        for pid, rss in tree_rss(self.pid).items():
            try:
                with open(f"/proc/{pid}/comm") as f:
                    name = f.read().strip()
            except OSError:
                name = "?"
            out[f"{name}[{pid}]"] = rss
        return out

    def log_errors(self, limit: int = 20) -> dict[str, Any]:
        """Lines of the server's log that say ERROR or Traceback: their count and the first
        ``limit`` (empty when attached by URL)."""
        if self.log_path is None or not os.path.exists(self.log_path):
            return {"count": 0, "first": []}
        with open(self.log_path, errors="replace") as f:
            bad = [line.rstrip() for line in f if "ERROR" in line or "Traceback" in line]
        return {"count": len(bad), "first": bad[:limit]}

    def summary(self, log_errors: dict[str, Any]) -> dict[str, Any]:
        """The result files' ``server`` record (after ``stop``): where it ran, how it was
        started, its log's error lines (``log_errors()``, read before stopping), its exit."""
        return {
            "url": self.url,
            "command": self.cmd,
            "log": self.log_path,
            "log_error_lines": log_errors,
            "exit_code": self.exit_code,
            "startup_s": round(self.startup_s, 1),
        }

    def stop(self) -> int | None:
        """SIGTERM a server this object started, wait, SIGKILL its process group if needed;
        its exit status (None when attached)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.exit_code = self.proc.returncode
        return self.exit_code

    def __enter__(self) -> LiveServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
