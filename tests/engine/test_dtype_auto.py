"""``dtype="auto"`` on the CPU: a bfloat16 checkpoint runs in bfloat16 where the CPU computes
in it natively (AVX512-BF16 or AMX), in float32 elsewhere; float16 becomes bfloat16 (or
float32); a float32 checkpoint stays float32; an explicit dtype is kept."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from pagedllm import config as config_mod
from pagedllm.config import EngineArgs


def _with_dtype(src: str, dst, dtype: str) -> str:  # noqa: ANN001
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["dtype"] = cfg["torch_dtype"] = dtype
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


@pytest.mark.parametrize("native", [True, False])
def test_auto_dtype_on_cpu(tiny_models, tmp_path, monkeypatch, native: bool) -> None:  # noqa: ANN001
    monkeypatch.setattr(config_mod, "cpu_has_bf16", lambda: native)
    want = "bfloat16" if native else "float32"
    for ckpt, expect in (("bfloat16", want), ("float16", want), ("float32", "float32")):
        path = _with_dtype(tiny_models("llama"), tmp_path / f"{ckpt}{native}", ckpt)
        mc = EngineArgs(model=path, device="cpu").create_engine_config().model_config
        assert mc.dtype == expect, ckpt
    explicit = EngineArgs(model=path, device="cpu", dtype="bfloat16").create_engine_config()
    assert explicit.model_config.dtype == "bfloat16"


def test_this_cpu_is_read() -> None:
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    assert config_mod.cpu_has_bf16() == ("avx512_bf16" in flags or "amx_bf16" in flags)
