"""Flags several benchmarks share, with the engine's own choices (``pagedllm.config``)."""

from __future__ import annotations

import argparse

from pagedllm.config import DEVICES, DTYPES, LOAD_FORMATS


def add_dtype(p: argparse.ArgumentParser, default: str = "auto") -> None:
    """``--dtype``."""
    p.add_argument(
        "--dtype",
        default=default,
        choices=list(DTYPES),
        help="Weight and activation dtype (auto: the model's own).",
    )


def add_device(p: argparse.ArgumentParser) -> None:
    """``--device``."""
    p.add_argument(
        "--device",
        default="auto",
        choices=list(DEVICES),
        help="Device (auto: cuda when a GPU is visible, else cpu).",
    )


def add_load_format(p: argparse.ArgumentParser) -> None:
    """``--load-format``."""
    p.add_argument(
        "--load-format",
        default="auto",
        choices=list(LOAD_FORMATS),
        help="Weight format (auto: gguf for a .gguf file, else safetensors; dummy: random "
        "weights).",
    )
