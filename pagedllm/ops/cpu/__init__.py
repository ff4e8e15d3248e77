"""Compiled CPU kernels (C++ through ``torch.utils.cpp_extension``), with PyTorch fallbacks.

``cpu_ops()`` builds ``paged_attention.cpp`` once per checkout and machine (``-O3
-march=native``: the machine's own vector instructions) into a cache folder
(``PAGEDLLM_CACHE_DIR``, default ``~/.cache/pagedllm``), keyed by the source, its path, the
torch version and the CPU, and returns the module; ``scripts/setup.sh`` builds it ahead. A
build (tens of seconds) is announced in one log line at INFO level with its time; a build
lock left by a killed build is removed rather than waited on. Without a compiler (or ninja), or with
``PAGEDLLM_CPU_KERNELS=0``, it returns None, saying so once in the log.

What it holds: the paged decode attention (used by the attention backend for float32 and
bfloat16 caches, ``kernels_enabled``; AMX tile products in bfloat16 where the CPU has them),
the paged prefill attention (``paged_prefill``, on CPUs with AVX512-BF16: bfloat16 by
VDPBF16PS or AMX tiles where there are, float32 by FMAs; faster than torch's SDPA at prompt
chunks, which it replaces there),
the KV write (``write_kv``, float32 and bfloat16, bit for bit), the greedy argmax
(``argmax``), and RMSNorm, rope and silu-and-mul (``rms_norm``, ``rope``, ``silu_and_mul``:
the layers take them for CPU tensors; in bfloat16 with PyTorch's roundings; in float32 rope
bit for bit, the norm and silu-and-mul within an ulp or two - ``PAGEDLLM_FLOAT32_EXACT=1``
keeps those two, and float32 matmuls, on PyTorch's ops).
``PAGEDLLM_CPU_KERNELS=0`` turns all of them off, and with them the oneDNN-packed bfloat16
and float32 matmuls (``pack_linear``, used by the linear layers and the LM head): the plain
PyTorch path, for A/B runs (``kernels_off``).

The decode kernel reads the paged cache in place, where torch's SDPA needs the keys and
values gathered (and its bfloat16 path is slower still than its float32 one): it is on for
both dtypes because whole runs are faster with it in each. ``benchmarks/throughput.py
--engines pagedllm`` run as is and with ``PAGEDLLM_CPU_KERNELS=0`` measures the kernels end to
end; ``benchmarks/cpu_kernel_ab.py`` times one attention kernel against a base commit's.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("paged_attention.cpp")
_loaded: list[Any] = []  # [module or None] once tried
# a build lock older than this was left by a build that was killed (a build takes a minute or
# two): torch's loader would wait for it forever
_STALE_LOCK_S = 600


def _cpu_tag() -> str:
    """The CPU's model name and flags (a build with -march=native belongs to one kind)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [x for x in text.splitlines() if x.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(lines))


@functools.lru_cache(maxsize=1)
def _build_key() -> str:
    """The source, its path, torch's version and the CPU, hashed once a process (``argmax``
    asks on every sampling step where the kernels were never built). The path: torch's build
    file names the source by it, so two checkouts sharing a build folder would rebuild each
    other's kernels, each rebuild racing the other checkout's processes."""
    import torch

    return hashlib.sha256(
        _SOURCE.read_bytes()
        + str(_SOURCE.resolve()).encode()
        + torch.__version__.encode()
        + _cpu_tag().encode()
    ).hexdigest()[:16]


def _drop_stale_lock(folder: Path) -> None:
    """Remove a build lock that a killed build left behind (see ``_STALE_LOCK_S``)."""
    lock = folder / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except OSError:
        return  # no lock: nobody is building
    if age > _STALE_LOCK_S:
        lock.unlink(missing_ok=True)
        logger.warning("removed a stale CPU-kernel build lock (%.0f s old) in %s", age, folder)


def build_dir() -> Path:
    root = Path(os.environ.get("PAGEDLLM_CACHE_DIR") or Path.home() / ".cache" / "pagedllm")
    return root / "cpu_ops" / _build_key()


def kernels_off() -> bool:
    """``PAGEDLLM_CPU_KERNELS=0``: every CPU speed path of this module off (read at each call,
    so a test or an A/B run can set it at any time)."""
    return os.environ.get("PAGEDLLM_CPU_KERNELS", "") == "0"


def kernels_enabled(dtype: Any = None) -> bool:
    """Whether the attention backend uses the compiled kernels for a cache of ``dtype``: for
    float32 and bfloat16 (the dtypes the kernel has), and the decode kernel for float8 e4m3
    (its bytes through a table, times the K / V scales), unless ``PAGEDLLM_CPU_KERNELS=0``.
    It computes in float32 and reads the cache in place, the query heads of a KV head
    together (torch's bfloat16 SDPA is several times slower than its float32 one)."""
    import torch

    if kernels_off():
        return False
    return dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn)


def cpu_ops(build: bool = True) -> Any:
    """The compiled module (``paged_decode``, ``argmax_last``), or None (see the module
    docstring). ``build=False``: None unless it is loaded or was built before (a build made
    from another checkout's path may still be redone by torch's loader)."""
    if _loaded:
        return _loaded[0]
    if not build:
        folder = build_dir()
        if not (folder / f"pagedllm_cpu_ops_{folder.name}.so").exists():
            return None
    module = None
    if not kernels_off():
        try:
            from torch.utils.cpp_extension import load

            folder = build_dir()
            folder.mkdir(parents=True, exist_ok=True)
            _drop_stale_lock(folder)
            name = f"pagedllm_cpu_ops_{folder.name}"
            # a build takes tens of seconds: say so in one line with its time (once a
            # checkout on a machine: cached)
            so = folder / f"{name}.so"
            before = so.stat().st_mtime_ns if so.exists() else None
            start = time.perf_counter()
            module = load(
                name=name,
                sources=[str(_SOURCE)],
                # -fopenmp: at::parallel_for spreads the (request, KV head) items over
                # torch's threads; -fno-math-errno lets the exponentials vectorize
                extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno"],
                build_directory=str(folder),
                verbose=False,
            )
            if before is None or so.stat().st_mtime_ns != before:
                logger.info(
                    "compiled the CPU kernels in %.1f s (%s; cached in %s)",
                    time.perf_counter() - start,
                    "first start of this checkout" if before is None else "the source changed",
                    folder,
                )
        except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a failed build
            logger.warning(
                "CPU kernels unavailable (%s): using the PyTorch attention path",
                str(e).splitlines()[0] if str(e) else type(e).__name__,
            )
            module = None
    _loaded.append(module)
    return module


def argmax(x: Any) -> Any:
    """``x.argmax(-1)`` of a [rows, n] tensor, the same indices (first maximum; first NaN),
    through the compiled ``argmax_last`` for a float32 or bfloat16 CPU tensor when the kernels
    are built (torch's CPU argmax keeps an index beside every comparison and does not
    vectorize; over a step's [rows, vocabulary] logits it costs several times this one). Where
    the kernels were never built it does not start a build (the torch path instead)."""
    import torch

    if (
        x.device.type == "cpu"
        and x.dim() == 2
        and x.shape[1] > 0
        and x.dtype in (torch.float32, torch.bfloat16)
        and not kernels_off()
    ):
        ops = cpu_ops(build=False)
        if ops is not None:
            return ops.argmax_last(x)
    return x.argmax(dim=-1)


def _small_ops(x: Any) -> Any:
    """The compiled module where ``x`` may take its element-wise ops (a float32 or bfloat16
    CPU tensor, the kernels on and built), else None. Never starts a build."""
    import torch

    if x.dtype not in (torch.bfloat16, torch.float32) or x.device.type != "cpu":
        return None
    if kernels_off():
        return None
    return cpu_ops(build=False)


def _float32_ops(x: Any, scalar_ok: bool = False) -> Any:
    """The compiled module where a float32 or bfloat16 CPU tensor may take the element-wise
    kernels that are not bit for bit PyTorch's in float32 (a different order of a sum, a
    polynomial exponential: within an ulp or two); float32 only where they are vectorized,
    or with ``scalar_ok`` where even the scalar loop beats PyTorch (the norm: one pass where
    PyTorch makes five; a scalar silu is slower than PyTorch's).
    ``PAGEDLLM_FLOAT32_EXACT=1`` keeps float32 on PyTorch's ops, bit for bit HF's."""
    import torch

    ops = _small_ops(x)
    if ops is None or x.dtype == torch.bfloat16:
        return ops
    if float32_exact() or not (scalar_ok or ops.small_ops_vectorized()):
        return None
    return ops


def rms_norm(x: Any, weight: Any, eps: float, offset: float, residual: Any = None) -> Any:
    """``RMSNorm.forward`` for a float32 or bfloat16 CPU tensor through the compiled
    ``rms_norm`` (the same arithmetic, and in bfloat16 the same roundings op for op; the sum
    of squares in another order): y, or (y, x + residual) with ``residual``; None where the
    kernels cannot take it (the caller runs the PyTorch code)."""
    ops = _float32_ops(x, scalar_ok=True)
    if ops is None or weight.dtype != x.dtype:
        return None
    if residual is not None and (residual.dtype != x.dtype or residual.shape != x.shape):
        return None
    out = ops.rms_norm(x, weight, eps, offset, residual)
    return out[0] if residual is None else (out[0], out[1])


def rope(x: Any, positions: Any, cos_sin: Any) -> Any:
    """``_rotate`` of rotary.py for a float32 or bfloat16 CPU [tokens, heads, head_dim] tensor
    through the compiled ``rope`` (PyTorch's operations in its order, no fused multiply-add:
    float32 results bit for bit); None where the kernels cannot take it."""
    ops = _small_ops(x)
    if ops is None or x.dim() != 3 or x.stride(-1) != 1 or x.shape[-1] % 2:
        return None
    return ops.rope(x, positions, cos_sin)


def silu_and_mul(x: Any) -> Any:
    """``SiluAndMul.forward`` (silu(gate) * up of x = [gate | up]) for a float32 or bfloat16
    CPU tensor in one compiled pass (``silu_and_mul``: PyTorch's roundings; its exponential is
    a polynomial, so float32 results are within an ulp or two of torch's, and a bfloat16 silu
    within ~2e-7 of a rounding boundary may round the other way - none in 3.1M random values);
    None where the kernels cannot take it."""
    ops = _float32_ops(x)
    if ops is None or x.shape[-1] % 2:
        return None
    return ops.silu_and_mul(x)


def write_kv(key: Any, value: Any, kv_cache: Any, slot_mapping: Any) -> bool:
    """``kv_layout.write_kv_ref`` through the compiled ``write_kv`` (a row copy per token)
    for a float32 or bfloat16 CPU cache whose dtype the keys and values have; False where the
    kernels cannot take it (the caller writes with the reference)."""
    ops = _small_ops(kv_cache)
    if (
        ops is None
        or not kv_cache.is_contiguous()
        or key.dtype != kv_cache.dtype
        or value.dtype != kv_cache.dtype
        or slot_mapping.dtype.is_floating_point
        or slot_mapping.device.type != "cpu"
    ):
        return False
    ops.write_kv(key, value, kv_cache[0], kv_cache[1], slot_mapping.long())
    return True


def float32_exact() -> bool:
    """``PAGEDLLM_FLOAT32_EXACT=1``: float32 layers on PyTorch's own ops (F.linear, the norm
    and silu-and-mul in PyTorch), bit for bit what HF computes; read at each call."""
    return os.environ.get("PAGEDLLM_FLOAT32_EXACT", "") == "1"


def pack_linear(weight: Any) -> Any:
    """A bfloat16 or float32 CPU weight [out, in] reordered once for oneDNN's matmul (the
    blocked layout its AMX / AVX512-BF16 / AVX-512 kernels read), or None where that does not
    apply: another dtype or device, a torch without oneDNN, ``kernels_off()``, float32 with
    ``float32_exact()``. In bfloat16 ``packed_linear`` with it gives F.linear's results bit
    for bit (tested), and faster (F.linear reorders the weight on every call). In float32 the
    sums run in another order than F.linear's (MKL's sgemm): within float32 rounding (tested),
    and faster on AMD CPUs, where MKL takes no AVX-512 path. ``benchmarks/throughput.py`` with
    and without ``PAGEDLLM_CPU_KERNELS=0`` measures it end to end. No compiler needed: the
    matmul is torch's own oneDNN.

    A bfloat16 weight on a CPU without bfloat16 instructions (no AVX512-BF16, no AMX:
    ``bf16_carrier()``) is packed as float32 copies of its bfloat16 values, which
    ``packed_linear`` multiplies by the bfloat16 activations widened to float32: a product of
    two bfloat16 numbers (8-bit significands) is exact in float32 and a bfloat16 matmul sums
    in float32 too, so the output is a bfloat16 matmul's up to the order of the sums (an ulp
    on ~0.02% of outputs), at float32's speed - on an AVX2 CPU 7x F.linear's emulated
    bfloat16 - for twice the weight's memory."""
    import torch

    if (
        weight.dtype not in (torch.bfloat16, torch.float32)
        or (weight.dtype == torch.float32 and float32_exact())
        or weight.device.type != "cpu"
        or weight.dim() != 2
        or kernels_off()
        or not torch.backends.mkldnn.is_available()
        or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    ):
        return None
    if weight.dtype == torch.bfloat16 and bf16_carrier():
        weight = weight.float()
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, 64)  # batch-size hint: decode
    except RuntimeError:  # a oneDNN build without bfloat16 kernels
        return None


def bf16_carrier() -> bool:
    """Whether bfloat16 matmuls run on float32 copies of the weights (``pack_linear``): on a
    CPU without bfloat16 instructions, unless ``PAGEDLLM_BF16_CARRIER=0``."""
    from pagedllm.config import cpu_has_bf16

    return os.environ.get("PAGEDLLM_BF16_CARRIER", "") != "0" and not cpu_has_bf16()


def packed_linear(x: Any, packed: Any, bias: Any) -> Any:
    """F.linear(x, W, bias) with ``packed = pack_linear(W)`` (a bfloat16 ``x`` over a float32
    carrier: widened, multiplied, the output rounded back to bfloat16)."""
    import torch

    if x.dtype == packed.dtype:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    b = None if bias is None else bias.float()
    y = torch.ops.mkldnn._linear_pointwise(x.float(), packed, b, "none", [], "")
    return y.to(x.dtype)
