"""Shared workload definitions for the CPU throughput benchmark.

This module is imported by the driver (``throughput.py``, project venv) *and* by the peer scripts
under ``peers/`` (run with other interpreters, e.g. the vLLM venv), so it depends only on the
standard library and numpy.  Every engine builds its prompts with :func:`random_prompts` from the
same arguments, so all engines see byte-identical token ids.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

#: Token ids below this value and at or above ``vocab_size - SPECIAL_MARGIN`` are never drawn, so
#: random prompts contain no BOS/EOS/pad or other special tokens.
SPECIAL_MARGIN = 100


def random_prompts(
    num_prompts: int,
    input_len: int,
    vocab_size: int,
    seed: int,
    range_ratio: float = 0.0,
) -> list[list[int]]:
    """Build ``num_prompts`` prompts of random token ids, deterministically.

    Args:
        num_prompts: number of prompts.
        input_len: prompt length in tokens (the centre of the range when ``range_ratio > 0``).
        vocab_size: the model's vocabulary size; ids are drawn from
            ``[SPECIAL_MARGIN, vocab_size - SPECIAL_MARGIN)``.
        seed: seed for ``numpy.random.default_rng``.
        range_ratio: when positive, each prompt length is drawn uniformly from
            ``[input_len * (1 - range_ratio), input_len * (1 + range_ratio)]`` (at least 1),
            as in vLLM's random dataset.

    Returns:
        A list of ``num_prompts`` lists of Python ints.
    """
    if num_prompts < 0 or input_len < 1:
        raise ValueError("num_prompts must be >= 0 and input_len >= 1")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError("range_ratio must be in [0, 1)")
    low, high = SPECIAL_MARGIN, vocab_size - SPECIAL_MARGIN
    if high <= low:
        raise ValueError(f"vocab_size {vocab_size} too small for random prompts")
    rng = np.random.default_rng(seed)
    if range_ratio > 0.0:
        lo_len = max(1, int(input_len * (1.0 - range_ratio)))
        hi_len = max(lo_len, int(input_len * (1.0 + range_ratio)))
        lengths = rng.integers(lo_len, hi_len + 1, size=num_prompts)
    else:
        lengths = np.full(num_prompts, input_len, dtype=np.int64)
    return [rng.integers(low, high, size=int(n)).tolist() for n in lengths]


def summarize_runs(
    elapsed_s: Sequence[float], num_prompts: int, input_tokens: int, output_tokens: int
) -> dict[str, Any]:
    """Turn wall-clock times of repeated runs into the benchmark's throughput fields.

    Args:
        elapsed_s: wall-clock seconds of each timed run (same workload each time).
        num_prompts: requests per run.
        input_tokens: prompt tokens per run (sum over prompts).
        output_tokens: generated tokens per run (sum over prompts).

    Returns:
        Median ``output_tok_s``, ``total_tok_s``, ``req_s`` and ``elapsed_s``, plus per-run lists.
    """
    runs = [
        {
            "elapsed_s": t,
            "output_tok_s": output_tokens / t,
            "total_tok_s": (input_tokens + output_tokens) / t,
            "req_s": num_prompts / t,
        }
        for t in elapsed_s
    ]
    med = statistics.median(elapsed_s)
    return {
        "elapsed_s": med,
        "output_tok_s": output_tokens / med,
        "total_tok_s": (input_tokens + output_tokens) / med,
        "req_s": num_prompts / med,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "runs": runs,
    }


def model_vocab_size(model_dir: str | Path) -> int:
    """Read ``vocab_size`` from an HF model folder's ``config.json``."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    if "vocab_size" not in cfg and "text_config" in cfg:
        cfg = cfg["text_config"]
    return int(cfg["vocab_size"])


def write_json(path: str | Path, data: dict[str, Any]) -> None:
    """Write ``data`` as indented JSON, creating parent folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


def load_by_path(name: str, path: str | Path) -> ModuleType:
    """Import a module from a file path without putting its folder on ``sys.path``."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
