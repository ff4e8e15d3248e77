"""Fixtures of the LoRA tests: a tiny Llama, two adapters of it and their merged copies."""

from __future__ import annotations

import pytest

from tests.lora.adapters import (
    ALL,
    MAX_NEW,
    PARAMS,
    engine,
    make_adapter,
    merged_copy,
    peft_greedy,
    prompts,
    tokens,
)


@pytest.fixture(scope="session")
def lora_setup(tiny_models, tmp_path_factory):
    """(base path, {name: adapter path}, {name: merged model path}): adapter "a1" (rank 8 on
    q, v, o, gate, down) and "a2" (rank 16, every projection, rsLoRA)."""
    base = tiny_models("llama")
    root = tmp_path_factory.mktemp("lora")
    adapters = {
        "a1": make_adapter(base, str(root / "a1"), 1, ["q_proj", "v_proj", "o_proj",
                                                       "gate_proj", "down_proj"], r=8, alpha=16),
        "a2": make_adapter(base, str(root / "a2"), 2, ALL, r=16, alpha=8, rslora=True),
    }  # fmt: skip
    merged = {n: merged_copy(base, p, str(root / f"{n}-merged")) for n, p in adapters.items()}
    return base, adapters, merged


@pytest.fixture(scope="session")
def references(lora_setup):
    """name -> greedy tokens of ``prompts()``: the merged checkpoints (and the base model) run
    alone by pagedllm, and HF + PEFT's (unmerged), which must agree; each adapter changes
    the base model's tokens."""
    base, adapters, merged = lora_setup
    ps = prompts()
    ours = {"base": tokens(engine(base).generate(ps, PARAMS, use_tqdm=False))}
    for name, path in merged.items():
        ours[name] = tokens(engine(path).generate(ps, PARAMS, use_tqdm=False))
    for name, path in adapters.items():
        assert peft_greedy(base, path, ps, MAX_NEW) == ours[name], name
        assert ours[name] != ours["base"], f"adapter {name} changes nothing"
    return ours
