"""logit_bias, allowed_token_ids and bad_words through ``LLM.generate`` on a tiny random
llama (byte-level tokenizer: one token per character), synchronous and async scheduling."""

from __future__ import annotations

import numpy as np
import pytest

from pagedllm import LLM, SamplingParams

PROMPTS = [
    {"prompt_token_ids": np.random.default_rng(s).integers(3, 250, size=n).tolist()}
    for s, n in [(0, 9), (1, 23), (2, 4)]
]


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(tiny_models, request) -> LLM:
    return LLM(
        tiny_models("llama"),
        dtype="float32",
        max_model_len=256,
        seed=0,
        async_scheduling=request.param,
    )


def _tokens(llm: LLM, params: SamplingParams, prompts: list = PROMPTS) -> list[list[int]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [list(c.token_ids) for o in outs for c in o.outputs]


def _id(llm: LLM, char: str) -> int:
    ids = llm.get_tokenizer().encode(char, add_special_tokens=False)
    assert len(ids) == 1
    return ids[0]


def test_bias_forces_and_forbids(llm):
    forced = SamplingParams(temperature=1.0, logit_bias={"77": 100}, max_tokens=12, ignore_eos=True)
    for toks in _tokens(llm, forced):
        assert toks == [77] * 12
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plain = _tokens(llm, greedy)
    firsts = {t[0] for t in plain}
    banned = SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True, logit_bias=dict.fromkeys(firsts, -100)
    )
    for toks in _tokens(llm, banned):
        assert not firsts & set(toks)


def test_allowed_token_ids_bound_every_draw_forks_included(llm):
    allowed = [5, 9, 200, 311]
    p = SamplingParams(
        n=3, temperature=1.0, seed=3, allowed_token_ids=allowed, max_tokens=16, ignore_eos=True
    )
    seqs = _tokens(llm, p)
    assert len(seqs) == 9 and all(len(s) == 16 for s in seqs)
    assert set().union(*seqs) <= set(allowed)
    assert len(set().union(*seqs)) > 1  # drawn among them


def test_multi_token_bad_word_banned_only_after_its_prefix(llm):
    """Only "a" and "b", "b" favoured by +50, "bb" a bad word: greedy alternates b, a, b, ...
    (the second b is banned only right after a b). Async scheduling turns synchronous for it:
    the ban reads the last sampled token on the host."""
    a, b = _id(llm, "a"), _id(llm, "b")
    base = dict(temperature=0, allowed_token_ids=[a, b], logit_bias={b: 50}, max_tokens=9)
    assert _tokens(llm, SamplingParams(**base, ignore_eos=True))[0] == [b] * 9
    p = SamplingParams(**base, bad_words=["bb"], ignore_eos=True)
    for toks in _tokens(llm, p):
        assert toks == [b, a] * 4 + [b]
    out = llm.generate(PROMPTS[0], p, use_tqdm=False)[0].outputs[0]
    assert out.text == "ba" * 4 + "b" and "bb" not in out.text


def test_one_token_bad_word_never_appears(llm):
    a, b = _id(llm, "a"), _id(llm, "b")
    p = SamplingParams(
        temperature=1.0,
        seed=1,
        allowed_token_ids=[a, b],
        logit_bias={b: 30},
        bad_words=["b"],
        max_tokens=12,
        ignore_eos=True,
    )
    for toks in _tokens(llm, p):
        assert toks == [a] * 12


def test_mixed_batch_with_unconstrained_requests(llm):
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = _tokens(llm, greedy)
    forced = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias={40: 100})
    outs = llm.generate(PROMPTS, [greedy, forced, greedy], use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert got[0] == alone[0] and got[2] == alone[2]
    assert got[1] == [40] * 8


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(logit_bias={512: 1.0}), "logit_bias"),
        (dict(allowed_token_ids=[3, 600]), "allowed_token_ids"),
        (dict(allowed_token_ids=[]), "allowed_token_ids"),
    ],
)
def test_ids_out_of_vocabulary_refused(llm, kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field} "):
        llm.generate(PROMPTS, SamplingParams(max_tokens=2, **kwargs), use_tqdm=False)
    # the engine still serves
    assert _tokens(llm, SamplingParams(max_tokens=2, ignore_eos=True))[0]
