"""Parallel sampling and beam search on a tiny random model: n sequences reproduce their
single-request seeds; beam search equals HF transformers' beam search."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.beam_search import BeamSearchParams


@pytest.fixture(scope="module")
def llm(tiny_models) -> LLM:
    return LLM(tiny_models("llama"), dtype="float32", max_model_len=256, seed=0)


def _prompt(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(3, 500, size=n).tolist()


@pytest.mark.parametrize("prompt_len", [21, 32])  # a partial last block, and a full one
def test_n4_each_sequence_equals_its_seed_alone(llm, prompt_len):
    p = {"prompt_token_ids": _prompt(prompt_len)}

    def params(seed, **kw):
        return SamplingParams(temperature=1.0, seed=seed, max_tokens=12, ignore_eos=True, **kw)

    group = llm.generate([p], params(5, n=4, logprobs=1), use_tqdm=False)[0]
    assert [c.index for c in group.outputs] == [0, 1, 2, 3]
    for i, c in enumerate(group.outputs):
        alone = llm.generate([p], params(5 + i, logprobs=1), use_tqdm=False)[0].outputs[0]
        assert c.token_ids == alone.token_ids
        assert c.cumulative_logprob == pytest.approx(alone.cumulative_logprob, abs=1e-4)
    core = llm.llm_engine.engine_core
    core.check_integrity()
    if prompt_len % 16:
        assert core.scheduler.kv_cache_manager.num_cow_copies > 0


def test_best_of_returns_the_best_by_cumulative_logprob(llm):
    p = {"prompt_token_ids": _prompt(10, 1)}
    many = llm.generate(
        [p],
        SamplingParams(temperature=1.0, seed=3, n=6, max_tokens=8, ignore_eos=True, logprobs=0),
        use_tqdm=False,
    )[0].outputs
    best = llm.generate(
        [p],
        SamplingParams(temperature=1.0, seed=3, n=2, best_of=6, max_tokens=8, ignore_eos=True),
        use_tqdm=False,
    )[0].outputs
    ranked = sorted(many, key=lambda c: c.cumulative_logprob, reverse=True)[:2]
    assert [c.token_ids for c in best] == [c.token_ids for c in ranked]
    assert [c.index for c in best] == [0, 1] and best[0].logprobs is None


def test_n_with_preemption_keeps_sequences(tiny_models):
    prompts = [{"prompt_token_ids": _prompt(30, i)} for i in range(3)]
    params = SamplingParams(temperature=1.0, seed=9, n=3, max_tokens=10, ignore_eos=True)
    roomy = LLM(tiny_models("llama"), dtype="float32", max_model_len=256)
    tight = LLM(
        tiny_models("llama"),
        dtype="float32",
        max_model_len=256,
        block_size=8,
        num_gpu_blocks_override=14,
    )
    a = roomy.generate(prompts, params, use_tqdm=False)
    b = tight.generate(prompts, params, use_tqdm=False)
    assert tight.llm_engine.engine_core.scheduler.num_preemptions > 0
    assert [[c.token_ids for c in o.outputs] for o in a] == [
        [c.token_ids for c in o.outputs] for o in b
    ]
    tight.llm_engine.engine_core.check_integrity()


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize(
    "length_penalty, early_stopping", [(1.0, False), (0.5, True), (2.0, "never")]
)
def test_beam_search_equals_hf(llm, tiny_models, k, length_penalty, early_stopping):
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(tiny_models("llama"), dtype=torch.float32)
    prompts = [_prompt(n, s) for n, s in ((7, 0), (19, 1), (33, 2))]
    params = BeamSearchParams(
        beam_width=k, max_tokens=10, length_penalty=length_penalty, early_stopping=early_stopping
    )
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            ref = model.generate(
                torch.tensor([p]),
                num_beams=k,
                num_return_sequences=k,
                do_sample=False,
                max_new_tokens=10,
                pad_token_id=0,
                length_penalty=length_penalty,
                early_stopping=early_stopping,
                eos_token_id=2,
            )
        ref_seqs = [row[len(p) :].tolist() for row in ref]
        ref_seqs = [s[: s.index(2) + 1] if 2 in s else s for s in ref_seqs]  # drop padding
        assert [s.tokens for s in out.sequences] == ref_seqs
    llm.llm_engine.engine_core.check_integrity()


def test_beam_blocks_are_shared_not_copied(llm):
    core = llm.llm_engine.engine_core
    kv = core.scheduler.kv_cache_manager
    before = kv.num_cow_copies
    llm.beam_search(
        [{"prompt_token_ids": _prompt(40, 5)}],
        BeamSearchParams(beam_width=4, max_tokens=8, ignore_eos=True),
    )
    # at most one partial block copied per fork: never whole sequences
    assert 0 < kv.num_cow_copies - before <= 4 * 8
    core.check_integrity()
    assert kv.num_free_blocks() == kv.num_blocks


def test_beam_search_stops_at_max_model_len(tiny_models):
    small = LLM(tiny_models("llama"), dtype="float32", max_model_len=48)
    out = small.beam_search(
        [{"prompt_token_ids": _prompt(40, 7)}],
        BeamSearchParams(beam_width=3, max_tokens=50, ignore_eos=True),
    )[0]
    assert all(len(s.tokens) == 8 for s in out.sequences)  # 48 - 40 tokens of room
    small.llm_engine.engine_core.check_integrity()


def test_bad_beam_params():
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="early_stopping"):
        BeamSearchParams(beam_width=2, max_tokens=4, early_stopping="sometimes")
