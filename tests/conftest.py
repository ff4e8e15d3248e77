"""Shared fixtures: tiny random-weight HF models made at test time (no downloads)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory):
    """A function arch -> path of a saved tiny random model of that architecture."""
    from tests.models.tiny import make_tiny_model

    cache: dict[str, str] = {}
    root = tmp_path_factory.mktemp("tiny_models")

    def get(arch: str) -> str:
        if arch not in cache:
            cache[arch] = make_tiny_model(arch, str(root / arch))
        return cache[arch]

    return get
