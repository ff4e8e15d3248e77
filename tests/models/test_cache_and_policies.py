"""Outputs do not change with prefix caching on or off, swap or recompute preemption, or the
scheduling policy; greedy and seeded sampling alike."""

from __future__ import annotations

import numpy as np
import pytest

from pagedllm import LLM, SamplingParams
from tests.models.tiny import hf_greedy

MAX_NEW = 10


def _shared_prefix_prompts(n: int = 8, prefix_len: int = 40, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, 500, size=prefix_len).tolist()
    return [
        prefix + rng.integers(3, 500, size=int(k)).tolist() for k in rng.integers(1, 20, size=n)
    ]


def _generate(path: str, prompts, params, **kw):
    llm = LLM(path, dtype="float32", max_model_len=256, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.llm_engine.engine_core.check_integrity()
    return llm, [o.outputs[0].token_ids for o in outs], outs


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_prefix_caching_on_off_equal_hf(arch, tiny_models):
    path = tiny_models(arch)
    prompts = _shared_prefix_prompts()
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    ref, _ = hf_greedy(path, prompts, MAX_NEW)
    # one request at a time, so later requests hit what earlier ones cached
    llm, on, outs = _generate(path, prompts, greedy, max_num_seqs=1)
    _, off, _ = _generate(path, prompts, greedy, enable_prefix_caching=False)
    assert on == off == ref
    assert sum(o.num_cached_tokens for o in outs) >= 7 * 32  # 2 blocks of 16 per later request
    assert llm.llm_engine.engine_core.scheduler.kv_cache_manager.prefix_cache_hits > 0


def test_prefix_caching_with_chunked_prefill_and_seeds(tiny_models):
    path = tiny_models("qwen3")
    prompts = _shared_prefix_prompts(seed=3)
    seeded = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=MAX_NEW, ignore_eos=True)
        for i in range(len(prompts))
    ]
    _, on, _ = _generate(path, prompts, seeded, max_num_batched_tokens=16)
    _, off, _ = _generate(path, prompts, seeded, enable_prefix_caching=False)
    assert on == off


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_swap_and_recompute_preemption_keep_outputs(mode, tiny_models):
    path = tiny_models("llama")
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 500, size=40).tolist() for _ in range(6)]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, seed=11, max_tokens=MAX_NEW, ignore_eos=True)
    _, ref_g, _ = _generate(path, prompts, greedy)
    _, ref_s, _ = _generate(path, prompts, seeded)
    kw = dict(
        block_size=8, num_gpu_blocks_override=12, preemption_mode=mode, enable_prefix_caching=False
    )
    if mode == "swap":
        kw["swap_space"] = 0.01
    llm, got_g, _ = _generate(path, prompts, greedy, **kw)
    sched = llm.llm_engine.engine_core.scheduler
    assert sched.num_preemptions > 0
    if mode == "swap":
        assert sched.num_swaps > 0
    _, got_s, _ = _generate(path, prompts, seeded, **kw)
    assert got_g == ref_g and got_s == ref_s


@pytest.mark.parametrize("policy", ["fcfs", "priority", "sjf"])
def test_every_policy_gives_the_same_tokens(policy, tiny_models):
    path = tiny_models("llama")
    rng = np.random.default_rng(9)
    prompts = [rng.integers(3, 500, size=int(n)).tolist() for n in rng.integers(2, 60, size=10)]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    _, ref, _ = _generate(path, prompts, greedy)
    llm = LLM(
        path,
        dtype="float32",
        max_model_len=256,
        scheduling_policy=policy,
        block_size=8,
        num_gpu_blocks_override=16,
        max_num_seqs=4,
    )
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        greedy,
        use_tqdm=False,
        priority=[i % 3 for i in range(len(prompts))],
    )
    assert [o.outputs[0].token_ids for o in outs] == ref
    llm.llm_engine.engine_core.check_integrity()
