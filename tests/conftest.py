"""Shared fixtures: tiny random-weight HF models made at test time (no downloads)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True, scope="session")
def _eager_when_asked():
    """PAGEDLLM_TEST_EAGER=1 runs every engine with enforce_eager=True (on a GPU: the same tests
    without CUDA graphs), so the greedy-equality tests cover both modes. PAGEDLLM_TEST_ASYNC=0/1
    sets async_scheduling for every engine that does not choose (e.g. the whole suite async on
    a CPU)."""
    eager = os.environ.get("PAGEDLLM_TEST_EAGER") == "1"
    asynch = os.environ.get("PAGEDLLM_TEST_ASYNC")
    if not eager and asynch is None:
        yield
        return
    from pagedllm.entrypoints import llm as llm_mod

    orig = llm_mod.LLM.__init__

    def init(self, model, **kw):  # noqa: ANN001, ANN202
        if eager:
            kw.setdefault("enforce_eager", True)
        if asynch is not None:
            kw.setdefault("async_scheduling", asynch == "1")
        orig(self, model, **kw)

    llm_mod.LLM.__init__ = init
    yield
    llm_mod.LLM.__init__ = orig


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
