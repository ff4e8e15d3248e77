"""Every Triton kernel of ``pagedllm/ops`` lowers to an sm_90 cubin in the variants the engine
launches (``hopper_compile.py``), on any machine with Triton's NVIDIA backend and its
``ptxas``: the interpreter the other kernel tests use here does not compile, and a kernel the
compiler rejects would only fail on the GPU. A kernel with no variant there fails too."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton", reason="triton is not installed")


def _ptxas() -> Path | None:
    try:
        import triton.backends.nvidia as nvidia
    except ImportError:
        return None
    path = Path(nvidia.__file__).parent / "bin" / "ptxas"
    return path if path.exists() else None


@pytest.mark.skipif(_ptxas() is None, reason="Triton's NVIDIA backend (ptxas) is not installed")
def test_kernels_compile_for_hopper(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")  # a real lowering, not a cache hit
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    script = Path(__file__).with_name("hopper_compile.py")
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    last = proc.stdout.strip().splitlines()[-1].split()  # "compiled N of M"
    assert last[0] == "compiled" and last[1] == last[3] and int(last[3]) >= 30, proc.stdout
