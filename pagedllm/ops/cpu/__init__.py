"""Compiled CPU kernels (C++ through ``torch.utils.cpp_extension``), with PyTorch fallbacks.

``cpu_ops()`` builds ``paged_attention.cpp`` once per machine (``-O3 -march=native``: the
machine's own vector instructions) into a cache folder (``PAGEDLLM_CACHE_DIR``, default
``~/.cache/pagedllm``), keyed by the source, the torch version and the CPU, and returns the
module; ``scripts/setup.sh`` builds it ahead. Without a compiler (or ninja), or with
``PAGEDLLM_CPU_KERNELS=0``, it returns None, saying so once in the log.

The attention backend uses it only with ``PAGEDLLM_CPU_KERNELS=1`` (``kernels_enabled``). On
the 2-core machine it was measured on, the decode kernel alone beat gather + SDPA (tiny
Llama shapes, 64 requests x 160 keys: 1.6-2.1 ms against 2.6-8 ms, noisy), but whole runs
were slower with it (tiny Llama fp32, 64 x 128 -> 64: ~1,050 against ~1,350 output tok/s), the
linear layers after it taking longer; until that is understood the PyTorch path stays the
default.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("paged_attention.cpp")
_loaded: list[Any] = []  # [module or None] once tried


def _cpu_tag() -> str:
    """The CPU's model name and flags (a build with -march=native belongs to one kind)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [x for x in text.splitlines() if x.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(lines))


def build_dir() -> Path:
    import torch

    key = hashlib.sha256(
        _SOURCE.read_bytes() + torch.__version__.encode() + _cpu_tag().encode()
    ).hexdigest()[:16]
    root = Path(os.environ.get("PAGEDLLM_CACHE_DIR") or Path.home() / ".cache" / "pagedllm")
    return root / "cpu_ops" / key


def kernels_enabled() -> bool:
    """Whether the attention backend should use the compiled kernels (opt-in for now)."""
    return os.environ.get("PAGEDLLM_CPU_KERNELS", "") == "1"


def cpu_ops() -> Any:
    """The compiled module (``paged_decode``), or None (see the module docstring)."""
    if _loaded:
        return _loaded[0]
    module = None
    if os.environ.get("PAGEDLLM_CPU_KERNELS", "1") != "0":
        try:
            from torch.utils.cpp_extension import load

            folder = build_dir()
            folder.mkdir(parents=True, exist_ok=True)
            module = load(
                name=f"pagedllm_cpu_ops_{folder.name}",
                sources=[str(_SOURCE)],
                # -fopenmp: at::parallel_for spreads the (request, KV head) items over
                # torch's threads; -fno-math-errno lets the exponentials vectorize
                extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno"],
                build_directory=str(folder),
                verbose=False,
            )
        except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a failed build
            logger.warning(
                "CPU kernels unavailable (%s): using the PyTorch attention path",
                str(e).splitlines()[0] if str(e) else type(e).__name__,
            )
            module = None
    _loaded.append(module)
    return module
