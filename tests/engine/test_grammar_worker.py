"""How the grammar worker process (``structured_output/grammar_worker.py``) stops. Started as
``GrammarProcess`` starts it (``python -m pagedllm.structured_output.grammar_worker CONN MEM``,
both descriptors inherited) but with its stderr captured: the engine closing the channel, at
any point, ends it with status 0 and prints nothing; Ctrl-C (SIGINT, which reaches the whole
process group) is left to the engine, which closes the channel; SIGTERM ends it without a
traceback; a bad "init" still prints its traceback and exits 1."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO

import pytest

from pagedllm.utils.channel import Channel

xgr = pytest.importorskip("xgrammar")

ROOT = Path(__file__).resolve().parents[2]
SHAPE = (2, 4, 1)  # turns, rows, 32-token words of the bitmask
INFO = xgr.TokenizerInfo(["a", "b", "c", "</s>"], stop_token_ids=[3]).serialize_json()


def _start() -> tuple[subprocess.Popen, Channel, IO[bytes]]:
    """The worker on one end of a socket pair, with a shared file for the bitmasks."""
    ours, theirs = socket.socketpair()
    mem = tempfile.TemporaryFile()
    os.ftruncate(mem.fileno(), 2 * 4 * 1 * 4)
    fds = (theirs.fileno(), mem.fileno())
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "pagedllm.structured_output.grammar_worker", *map(str, fds)]
    proc = subprocess.Popen(
        cmd, pass_fds=fds, env=env, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    theirs.close()
    return proc, Channel(ours), mem


def _init(conn: Channel) -> None:
    conn.send(("init", INFO, SHAPE, 1))
    assert conn.recv(timeout=60) == ("ready",)


def _step(conn: Channel) -> None:
    conn.send(("step", [], [], 0))
    assert conn.recv(timeout=60)[0] == "step"


def _end(proc: subprocess.Popen) -> tuple[int, str]:
    _, err = proc.communicate(timeout=60)
    return proc.returncode, err


def test_closed_before_init_ends_quietly() -> None:
    proc, conn, mem = _start()
    conn.close()
    code, err = _end(proc)
    mem.close()
    assert (code, err) == (0, ""), err


def test_closed_after_steps_ends_quietly() -> None:
    proc, conn, mem = _start()
    _init(conn)
    _step(conn)
    conn.send(("step", [], [], 1))  # its answer finds the channel closed
    conn.close()
    code, err = _end(proc)
    mem.close()
    assert (code, err) == (0, ""), err


def test_ctrl_c_is_left_to_the_engine() -> None:
    proc, conn, mem = _start()
    _init(conn)
    proc.send_signal(signal.SIGINT)
    _step(conn)  # still serving: the engine decides when it ends
    conn.close()
    code, err = _end(proc)
    mem.close()
    assert (code, err) == (0, ""), err


def test_sigterm_ends_it_without_a_traceback() -> None:
    proc, conn, mem = _start()
    _init(conn)
    proc.terminate()
    code, err = _end(proc)
    conn.close()
    mem.close()
    assert code == -signal.SIGTERM and "Traceback" not in err, err


def test_a_bad_init_still_reports() -> None:
    proc, conn, mem = _start()
    conn.send(("init", "not a tokenizer", SHAPE, 1))
    code, err = _end(proc)
    conn.close()
    mem.close()
    assert code == 1 and "Traceback" in err, (code, err)
