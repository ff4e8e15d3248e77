"""A build of the CPU kernels (``pagedllm.ops.cpu.cpu_ops``) is announced in one log line with
its time; a start that finds the build cached says nothing. The compiler is
replaced by a stand-in that writes the shared object where torch's loader would: a real build
takes tens of seconds (the kernel tests beside this one run it)."""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path

import pytest
import torch.utils.cpp_extension

from pagedllm.ops import cpu

FIRST = re.compile(
    r"compiled the CPU kernels in \d+\.\d s \(first start of this checkout; cached in .+\)"
)
AFTER = re.compile(r"compiled the CPU kernels in \d+\.\d s \(the source changed; cached in .+\)")


def test_a_build_is_announced_with_its_time(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rebuild = []  # torch's loader builds again when its record of the build is stale

    def load(name: str, build_directory: str, **_: object) -> object:
        so = Path(build_directory) / f"{name}.so"
        if not so.exists() or rebuild:
            so.write_bytes(b"")
        return object()

    monkeypatch.setattr(torch.utils.cpp_extension, "load", load)
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PAGEDLLM_CPU_KERNELS", raising=False)
    caplog.set_level(logging.INFO, logger=cpu.__name__)

    def start() -> list[str]:
        """A new process's first call: nothing loaded yet."""
        monkeypatch.setattr(cpu, "_loaded", [])
        caplog.clear()
        assert cpu.cpu_ops() is not None
        return [r.getMessage() for r in caplog.records]

    first = start()
    assert len(first) == 1 and FIRST.fullmatch(first[0]), first
    assert start() == []  # cached
    so = next(tmp_path.rglob("*.so"))
    os.utime(so, ns=(0, 0))
    rebuild.append(True)
    again = start()
    assert len(again) == 1 and AFTER.fullmatch(again[0]), again


def test_a_stale_build_lock_is_removed_and_a_recent_one_kept(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A build killed mid-way leaves torch's lock file, on which every later start would wait
    forever: a lock older than any build is removed (with a warning); a recent one is another
    process's build in progress and stays."""
    seen = []

    def load(name: str, build_directory: str, **_: object) -> object:
        seen.append((Path(build_directory) / "lock").exists())
        (Path(build_directory) / f"{name}.so").write_bytes(b"")
        return object()

    monkeypatch.setattr(torch.utils.cpp_extension, "load", load)
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PAGEDLLM_CPU_KERNELS", raising=False)
    caplog.set_level(logging.INFO, logger=cpu.__name__)
    folder = cpu.build_dir()
    folder.mkdir(parents=True)
    lock = folder / "lock"
    for age, kept in ((cpu._STALE_LOCK_S + 60, False), (5, True)):
        lock.touch()
        old = time.time() - age
        os.utime(lock, (old, old))
        monkeypatch.setattr(cpu, "_loaded", [])
        caplog.clear()
        assert cpu.cpu_ops() is not None
        assert seen[-1] is kept and lock.exists() is kept
        warned = [r for r in caplog.records if "stale CPU-kernel build lock" in r.getMessage()]
        assert len(warned) == (0 if kept else 1)
