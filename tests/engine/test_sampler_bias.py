"""logit_bias, allowed_token_ids and bad_words: validation, tokenization of bad words, and the
sampler (through the InputBatch and build_sampling_metadata, as the runner calls it)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pagedllm.core.request import Request
from pagedllm.core.sched.output import NewRequestData
from pagedllm.engine.input_processor import InputProcessor
from pagedllm.sample.sampler import Sampler, SamplerOutput, SamplingMetadata
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.sampling_inputs import build_sampling_metadata

VOCAB = 64
CPU = torch.device("cpu")


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(logit_bias={1: 101}), "logit_bias"),
        (dict(logit_bias={1: -100.5}), "logit_bias"),
        (dict(logit_bias={1: math.inf}), "logit_bias"),
        (dict(logit_bias={1: math.nan}), "logit_bias"),
        (dict(logit_bias={1: True}), "logit_bias"),
        (dict(logit_bias={1: "5"}), "logit_bias"),
        (dict(logit_bias={"abc": 1}), "logit_bias"),
        (dict(logit_bias={"1.5": 1}), "logit_bias"),
        (dict(logit_bias={"-1": 1}), "logit_bias"),
        (dict(logit_bias={-1: 1}), "logit_bias"),
        (dict(logit_bias={"9" * 5000: 1}), "logit_bias"),
        (dict(logit_bias={1: 1, "1": 2}), "logit_bias"),  # the same id twice
        (dict(logit_bias={i: 1.0 for i in range(1025)}), "logit_bias"),
        (dict(logit_bias=[1, 2]), "logit_bias"),
        (dict(allowed_token_ids=[]), "allowed_token_ids"),
        (dict(allowed_token_ids=[1, -2]), "allowed_token_ids"),
        (dict(allowed_token_ids=[1, "2"]), "allowed_token_ids"),
        (dict(allowed_token_ids=[True]), "allowed_token_ids"),
        (dict(allowed_token_ids=5), "allowed_token_ids"),
        (dict(bad_words="hello"), "bad_words"),
        (dict(bad_words=["ok", ""]), "bad_words"),
        (dict(bad_words=["  "]), "bad_words"),
        (dict(bad_words=[5]), "bad_words"),
        (dict(bad_words=["x" * 1025]), "bad_words"),
        (dict(bad_words=[f"w{i}" for i in range(65)]), "bad_words"),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field} "):
        SamplingParams(**kwargs)


def test_valid_values_are_normalised():
    p = SamplingParams(
        logit_bias={"5": 100, 7: -100, " 9": 0.5},
        allowed_token_ids=(3, 4),
        bad_words=["x" * 1024] * 64,
    )
    assert p.logit_bias == {5: 100.0, 7: -100.0, 9: 0.5}
    assert all(type(k) is int and type(v) is float for k, v in p.logit_bias.items())
    assert p.allowed_token_ids == [3, 4]
    assert SamplingParams(logit_bias={i: 1.0 for i in range(1024)}).logit_bias is not None


class FakeTokenizer:
    """Whole strings to token ids: a word inside a text (with a space) may be other tokens."""

    PIECES = {
        "hello": [10],
        " hello": [11],  # the space folded into another first token: both forms
        "world": [12, 13],
        " world": [14, 13],
        "a b": [20, 21, 22],
        " a b": [21, 20, 21, 22],  # the space a token of its own: the plain form only
        "same": [30, 31],
        " same": [30, 31],  # the same tokens: once
        "big": [70],
    }
    eos_token_id = 2

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert not add_special_tokens
        return self.PIECES.get(text, [])


def _processor(vocab: int = VOCAB, tokenizer: object = None) -> InputProcessor:
    mc = SimpleNamespace(vocab_size=vocab, max_model_len=128, text_config=SimpleNamespace())
    return InputProcessor(mc, tokenizer or FakeTokenizer())  # type: ignore[arg-type]


def test_bad_words_tokenized_once_with_the_prefix_space_form():
    user = SamplingParams(bad_words=["hello", "  world", "a b", "same"])
    req, _ = _processor().process("r", [5, 6], user)
    p = req.sampling_params
    assert p.bad_words_token_ids == [[10], [11], [12, 13], [14, 13], [20, 21, 22], [30, 31]]
    assert user.bad_words_token_ids is None  # the engine's copy, not the caller's object
    assert p.bad_words_need_history and req.needs_host_tokens  # multi-token: synchronous


def test_single_token_bad_words_bias_and_allowed_ids_keep_async_steps():
    p = SamplingParams(bad_words=["hello"], logit_bias={3: 1}, allowed_token_ids=[3, 4])
    req, _ = _processor().process("r", [5, 6], p)
    assert req.sampling_params.bad_words_token_ids == [[10], [11]]
    assert not req.needs_host_tokens


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(logit_bias={VOCAB: 1.0}), "logit_bias"),
        (dict(logit_bias={"999": 1.0}), "logit_bias"),
        (dict(allowed_token_ids=[1, VOCAB]), "allowed_token_ids"),
        (dict(allowed_token_ids=[1] * (VOCAB + 1)), "allowed_token_ids"),
        (dict(bad_words=["big"]), "bad_words"),  # tokenizes to id 70 >= 64
        (dict(bad_words=["unknown"]), "bad_words"),  # no tokens
    ],
)
def test_ids_checked_against_the_vocabulary(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field} "):
        _processor().process("r", [5, 6], SamplingParams(**kwargs))


def test_fields_set_after_construction_are_checked_again():
    p = SamplingParams()
    p.allowed_token_ids = [-1]
    with pytest.raises(ValueError, match=r"^allowed_token_ids "):
        _processor().process("r", [5, 6], p)


def test_bad_words_need_a_tokenizer():
    proc = _processor()
    proc.tokenizer = None
    with pytest.raises(ValueError, match=r"^bad_words "):
        proc.process("r", [5, 6], SamplingParams(bad_words=["hello"]))


# ---------------------------------------------------------------- the sampler


def _batch(
    specs: list[tuple[SamplingParams, list[int]]], drafts: list[list[int]] | None = None
) -> tuple[InputBatch, np.ndarray, SamplingMetadata]:
    """An InputBatch of requests (params, output tokens so far; prompt [1, 5, 6]) through the
    input processor, and the metadata of a step where each samples."""
    ib = InputBatch(max_num_reqs=len(specs), max_model_len=64, block_size=16)
    proc = _processor()
    rows = []
    for i, (params, output) in enumerate(specs):
        req, _ = proc.process(str(i), [1, 5, 6], params)
        new = NewRequestData(str(i), [1, 5, 6], list(output), req.sampling_params, (), 0)
        rows.append(ib.add_request(new))
    gen = torch.Generator().manual_seed(0)
    md = build_sampling_metadata(ib, np.array(rows), CPU, gen, {2}, drafts)
    return ib, np.array(rows), md


def _sample(specs, logits, drafts=None) -> tuple[SamplerOutput, SamplingMetadata]:  # noqa: ANN001
    _, _, md = _batch(specs, drafts)
    return Sampler()(logits.clone(), md), md


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed))


GREEDY = dict(temperature=0.0, max_tokens=8)
RANDOM = dict(temperature=1.0, max_tokens=8)


@pytest.mark.parametrize("kind", [GREEDY, RANDOM])
def test_bias_plus_100_forces_and_minus_100_forbids(kind):
    rows = 64
    logits = _logits(rows)
    forced = [(SamplingParams(logit_bias={"17": 100}, **kind), [])] * rows
    out, md = _sample(forced, logits)
    assert not md.argmax_only and md.constraints is not None
    assert out.sampled.tolist() == [17] * rows
    logits[:, 23] += 15.0  # token 23 is each row's favourite by far
    plain, _ = _sample([(SamplingParams(**kind), [])] * rows, logits)
    assert plain.sampled.tolist() == [23] * rows  # (so the next assertion can fail)
    banned, _ = _sample([(SamplingParams(logit_bias={23: -100}, **kind), [])] * rows, logits)
    assert 23 not in banned.sampled.tolist()


def test_bias_shifts_greedy_by_its_value():
    logits = torch.zeros(1, VOCAB)
    logits[0, 4], logits[0, 9] = 3.0, 1.0
    out, _ = _sample([(SamplingParams(logit_bias={9: 1.5}, **GREEDY), [])], logits)
    assert out.sampled.tolist() == [4]
    out, _ = _sample([(SamplingParams(logit_bias={9: 2.5}, **GREEDY), [])], logits)
    assert out.sampled.tolist() == [9]


@pytest.mark.parametrize("kind", [GREEDY, RANDOM])
def test_allowed_ids_restrict_draws(kind):
    rows, allowed = 64, [3, 40, 41, 63]
    logits = _logits(rows, seed=1)
    out, _ = _sample([(SamplingParams(allowed_token_ids=allowed, **kind), [])] * rows, logits)
    got = out.sampled.tolist()
    assert set(got) <= set(allowed)
    if kind is GREEDY:  # the best allowed token of each row
        best = [allowed[i] for i in logits[:, allowed].argmax(-1).tolist()]
        assert got == best
    else:
        assert len(set(got)) > 1  # a draw among them, not a fixed token


def test_bad_words_ban_the_last_token_only_after_the_prefix():
    # "world" = [12, 13] (and " world" = [14, 13]); "hello" = [10] / [11]; "a b" = [20, 21, 22]
    logits = torch.zeros(6, VOCAB)
    for t in (10, 11, 13, 22):
        logits[:, t] = 5.0 + t / 100  # favourites: 22, then 13, then 11, then 10
    p = SamplingParams(bad_words=["hello", "world", "a b"], **GREEDY)
    specs = [
        (p, []),  # nothing before: 22 is free (and 10, 11 are banned)
        (p, [20, 21]),  # "a b" prefix: 22 banned -> 13
        (p, [7, 21]),  # 21 alone: 22 free
        (p, [20, 21, 12]),  # "world" prefix [12]: 13 banned, 22 free
        (p, [20, 21, 14]),  # " world" prefix [14]: 13 banned, 22 free
        (SamplingParams(**GREEDY), [20, 21]),  # no bad words: untouched
    ]
    out, _ = _sample(specs, logits)
    assert out.sampled.tolist() == [22, 13, 22, 22, 22, 22]
    logits[:, 22] = 0.0
    out, _ = _sample(specs, logits)
    # without 22: 13 where not after 12 / 14; never 10 or 11
    assert out.sampled.tolist() == [13, 13, 13, 0, 0, 13]


def test_bad_words_read_the_output_not_the_prompt():
    # the prompt ends with 12, the first token of "world": its 13 stays free at output 0
    ib = InputBatch(max_num_reqs=1, max_model_len=64, block_size=16)
    req, _ = _processor().process("r", [1, 12], SamplingParams(bad_words=["world"], **GREEDY))
    ib.add_request(NewRequestData("r", [1, 12], [], req.sampling_params, (), 0))
    md = build_sampling_metadata(ib, np.array([0]), CPU, torch.Generator(), set())
    logits = torch.zeros(1, VOCAB)
    logits[0, 13] = 1.0
    assert Sampler()(logits, md).sampled.tolist() == [13]


def test_bad_words_count_drafts_before_the_position():
    # a row verifying drafts [20, 21] samples at 3 positions: after [], [20], [20, 21]
    logits = torch.zeros(3, VOCAB)
    logits[:, 22] = 1.0
    out, md = _sample([(SamplingParams(bad_words=["a b"], **GREEDY), [])], logits, [[20, 21]])
    assert md.output_positions == [0, 1, 2]
    assert out.sampled.tolist() == [22, 22, 0]


def test_mixed_batch_leaves_other_rows_and_raw_logprobs_untouched():
    rows = 8
    logits = _logits(rows, seed=3)
    plain = dict(temperature=1.0, seed=7, logprobs=2, max_tokens=8)
    specs = [(SamplingParams(**plain), [4])] * rows
    ref, _ = _sample(specs, logits)
    specs[1] = (SamplingParams(logit_bias={5: 100}, **plain), [4])
    specs[4] = (SamplingParams(allowed_token_ids=[6, 7], **plain), [4])
    specs[6] = (SamplingParams(bad_words=["hello", "world"], **plain), [12])
    got, md = _sample(specs, logits)
    assert md.constraints is not None
    assert md.constraints.bias is not None and md.constraints.bias[0].tolist() == [1]
    assert md.constraints.allowed_rows is not None
    assert md.constraints.allowed_rows.tolist() == [4]
    assert md.constraints.banned is not None
    assert md.constraints.banned[0].tolist() == [6, 6, 6] and md.constraints.banned[1].tolist() == [
        10,
        11,
        13,
    ]
    others = [0, 2, 3, 5, 7]
    assert got.sampled[others].tolist() == ref.sampled[others].tolist()
    assert int(got.sampled[1]) == 5 and int(got.sampled[4]) in (6, 7)
    assert int(got.sampled[6]) not in (10, 11, 13)
    # logprobs are the raw model's: the same top-2 for every row
    assert torch.equal(got.logprob_ids[:, 1:], ref.logprob_ids[:, 1:])
    raw = logits.log_softmax(-1)
    sampled = got.sampled[:, None]
    assert torch.allclose(got.logprobs[:, :1], raw.gather(1, sampled))


def test_no_constraints_no_tensors_and_argmax_only_stays():
    _, _, md = _batch([(SamplingParams(**GREEDY), [])] * 3)
    assert md.constraints is None and md.argmax_only
    # a longer bad word whose prefix does not end the output changes nothing this step
    _, _, md = _batch([(SamplingParams(bad_words=["world"], **GREEDY), [3])])
    assert md.constraints is None and md.argmax_only
    _, _, md = _batch([(SamplingParams(bad_words=["world"], **GREEDY), [12])])
    assert md.constraints is not None and not md.argmax_only


@pytest.mark.parametrize("kind", ["bias", "allowed", "bad"])
def test_fork_rows_get_their_source_rows_constraints(kind):
    """n = 4 at output 0: three extra samples drawn inside the sampler from the same logits
    carry the request's constraints (a plain n = 3 request beside them stays free)."""
    extra = {
        "bias": dict(logit_bias={9: 100}),
        "allowed": dict(allowed_token_ids=[30, 31, 32]),
        "bad": dict(bad_words=["hello"]),
    }[kind]
    logits = _logits(2, seed=5)
    logits[:, 10] += 20.0  # "hello" is everyone's favourite
    logits[:, 11] += 10.0
    specs = [
        (SamplingParams(n=4, temperature=1.0, max_tokens=8, **extra), []),
        (SamplingParams(n=3, temperature=1.0, max_tokens=8), []),
    ]
    out, md = _sample(specs, logits)
    assert md.fork_src is not None and md.fork_src.tolist() == [0, 0, 0, 1, 1]
    assert out.forks is not None
    constrained = [int(out.sampled[0])] + out.forks.sampled[:3].tolist()
    free = [int(out.sampled[1])] + out.forks.sampled[3:].tolist()
    assert free == [10] * 3
    if kind == "bias":
        assert constrained == [9] * 4
    elif kind == "allowed":
        assert set(constrained) <= {30, 31, 32}
    else:
        assert not set(constrained) & {10, 11}


def test_bias_between_min_tokens_and_penalties():
    """The order (vLLM's): a bias cannot undo the min_tokens mask, and the penalties apply
    to the biased logits."""
    logits = torch.zeros(1, VOCAB)
    p = SamplingParams(logit_bias={2: 100, 8: 50}, min_tokens=2, **GREEDY)
    out, _ = _sample([(p, [])], logits)
    assert out.sampled.tolist() == [8]  # EOS (2) held back by min_tokens despite +100
    logits[0, 9] = 4.0
    p = SamplingParams(logit_bias={8: 10}, **GREEDY)
    out, _ = _sample([(p, [8])], logits)
    assert out.sampled.tolist() == [8]  # 10 > 4
    p = SamplingParams(logit_bias={8: 10}, presence_penalty=2.0, repetition_penalty=2.0, **GREEDY)
    out, _ = _sample([(p, [8])], logits)
    # bias then penalties: 10 / 2 - 2 = 3 < 4 (penalties then bias would give 0 - 2 + 10 = 8)
    assert out.sampled.tolist() == [9]


def test_request_with_bad_words_needs_host_tokens():
    p = SamplingParams(bad_words=["world"])
    p.update_from_tokenizer(FakeTokenizer())
    assert Request("r", [1], p).needs_host_tokens
    assert not Request("r", [1], SamplingParams(logit_bias={1: 1.0})).needs_host_tokens


@pytest.mark.parametrize("kind", [GREEDY, RANDOM])
def test_min_tokens_yields_where_it_would_leave_no_token(kind):
    """A row whose only finite logit is EOS (a grammar that must end now) samples EOS even
    before min_tokens; a row with other tokens still has EOS held back."""
    logits = torch.zeros(2, VOCAB)
    logits[0] = -float("inf")
    logits[0, 2] = 0.0  # row 0: the grammar accepts EOS (2) only
    logits[1, 2] = 50.0  # row 1: EOS is the favourite, other tokens are allowed
    p = SamplingParams(min_tokens=5, **kind)
    out, _ = _sample([(p, []), (p, [])], logits)
    assert out.sampled.tolist()[0] == 2
    assert out.sampled.tolist()[1] != 2
