"""The hybrid KV manager under everything else the engine does, on tiny Gemma 3 (sliding
window 12 on three of four layers: four groups) with prompts well past the window: parallel
sampling (copy-on-write in every group), beam search against HF, swap and recompute
preemption, async scheduling, and the tokens of the single-table layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.beam_search import BeamSearchParams
from pagedllm.core.kv_cache.hybrid import HybridKVCacheManager

MAX_NEW = 10


def _prompts(n: int = 5, seed: int = 4) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, size=int(k)).tolist() for k in rng.integers(20, 70, size=n)]


def _run(path: str, prompts: list[list[int]], params: SamplingParams, **kw):
    llm = LLM(path, dtype="float32", max_model_len=256, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.llm_engine.engine_core.check_integrity()
    return llm, [[c.token_ids for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def gemma(tiny_models) -> str:
    return tiny_models("gemma3")


def test_single_table_and_hybrid_agree_with_sampling(gemma):
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=MAX_NEW, ignore_eos=True)
    llm, hybrid = _run(gemma, _prompts(), params)
    assert isinstance(llm.llm_engine.engine_core.scheduler.kv_cache_manager, HybridKVCacheManager)
    _, single = _run(gemma, _prompts(), params, disable_hybrid_kv_cache_manager=True)
    assert hybrid == single


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_tokens(gemma, mode):
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    _, ref = _run(gemma, _prompts(), greedy)
    # 16-token chunks: a window group holds at most 5 blocks of 8, a request of 80 tokens 25
    # in all; 30 blocks cannot hold two
    kw: dict = dict(
        block_size=8, num_gpu_blocks_override=30, preemption_mode=mode, max_num_batched_tokens=16
    )
    if mode == "swap":
        kw["swap_space"] = 0.01
    llm, got = _run(gemma, _prompts(), greedy, enable_prefix_caching=False, **kw)
    sched = llm.llm_engine.engine_core.scheduler
    assert sched.num_preemptions > 0 and (mode != "swap" or sched.num_swaps > 0)
    assert got == ref


def test_async_scheduling_keeps_tokens(gemma):
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    _, ref = _run(gemma, _prompts(), greedy, async_scheduling=False)
    _, got = _run(gemma, _prompts(), greedy, async_scheduling=True, max_num_batched_tokens=32)
    assert got == ref


def test_n3_sequences_equal_their_seeds_alone(gemma):
    p = _prompts(1, seed=9)  # one prompt past the window, a partial last block

    def params(seed: int, n: int = 1) -> SamplingParams:
        return SamplingParams(temperature=1.0, seed=seed, n=n, max_tokens=MAX_NEW, ignore_eos=True)

    llm, group = _run(gemma, p, params(3, n=3))
    assert llm.llm_engine.engine_core.scheduler.kv_cache_manager.num_cow_copies > 0
    for i, tokens in enumerate(group[0]):
        outs = llm.generate([{"prompt_token_ids": p[0]}], params(3 + i), use_tqdm=False)
        assert outs[0].outputs[0].token_ids == tokens


def test_beam_search_equals_hf(gemma):
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(gemma, dtype=torch.float32)
    llm = LLM(gemma, dtype="float32", max_model_len=256)
    for prompt in _prompts(2, seed=11):
        out = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(2, max_tokens=8))
        with torch.no_grad():
            ref = model.generate(
                torch.tensor([prompt]),
                num_beams=2,
                num_return_sequences=2,
                do_sample=False,
                max_new_tokens=8,
                pad_token_id=0,
                eos_token_id=2,
            )
        ref_seqs = [row[len(prompt) :].tolist() for row in ref]
        ref_seqs = [s[: s.index(2) + 1] if 2 in s else s for s in ref_seqs]
        assert [s.tokens for s in out[0].sequences] == ref_seqs
    llm.llm_engine.engine_core.check_integrity()
