"""Fixtures of the model tests: HF's greedy reference on the equality prompts."""

from __future__ import annotations

import pytest

from tests.models.test_hf_equality import MAX_NEW, _prompts
from tests.models.tiny import hf_greedy


@pytest.fixture(scope="module")
def reference(tiny_models):
    """arch -> HF greedy (tokens, logprobs) of the equality prompts, computed once a module."""
    cache = {}

    def get(arch: str):
        if arch not in cache:
            cache[arch] = hf_greedy(tiny_models(arch), _prompts(), MAX_NEW)
        return cache[arch]

    return get
