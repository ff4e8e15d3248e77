"""The n-gram (prompt lookup) proposer: exact drafts on small cases, a brute-force reference on
random token lists (fed incrementally and fresh), and a 256 x 2,000-token run."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pagedllm.spec_decode import SpeculativeConfig, make_proposer
from pagedllm.spec_decode.ngram import NgramProposer, ngram_propose
from tests.spec_decode.engine_shape import run_engine_shape


def _proposer(k: int = 4, lo: int | None = None, hi: int | None = None) -> NgramProposer:
    d: dict = {"method": "ngram", "num_speculative_tokens": k}
    if lo is not None:
        d["prompt_lookup_min"] = lo
    if hi is not None:
        d["prompt_lookup_max"] = hi
    p = make_proposer(SpeculativeConfig.from_dict(d))
    assert isinstance(p, NgramProposer)
    return p


def _reference(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    """The rule written plainly: largest n first, most recent earlier occurrence, the draft
    copying on past the end (each token after the end is the one a period before it)."""
    n_tok = len(tokens)
    for n in range(hi, lo - 1, -1):
        if n >= n_tok:
            continue
        suffix = tokens[n_tok - n :]
        for start in range(n_tok - n - 1, -1, -1):  # most recent first, before the suffix
            if tokens[start : start + n] == suffix:
                text = list(tokens)
                for i in range(k):
                    text.append(text[start + n + i])
                return text[n_tok : n_tok + k]
    return []


def test_repeated_text_yields_its_continuation() -> None:
    p = _proposer(k=3, lo=2, hi=3)
    text = [10, 11, 12, 13, 14, 15, 20, 21, 10, 11, 12]
    assert p.propose("r", text, num_prompt_tokens=8, k=3) == [13, 14, 15]


def test_no_match_gives_nothing() -> None:
    p = _proposer(k=3, lo=1, hi=3)
    assert p.propose("r", [1, 2, 3, 4, 5], 5, 3) == []
    assert p.propose("r2", [7], 1, 3) == []  # nothing before the last token
    assert p.propose("r3", [], 0, 3) == []


def test_k_caps_the_draft_and_k_zero_gives_nothing() -> None:
    p = _proposer(k=8, lo=2, hi=2)
    text = list(range(10)) + [0, 1]
    assert p.propose("r", text, 12, 8) == [2, 3, 4, 5, 6, 7, 8, 9]
    assert p.propose("r", text, 12, 3) == [2, 3, 4]
    assert p.propose("r", text, 12, 0) == []
    with pytest.raises(ValueError, match="k must be"):
        p.propose("r", text, 12, -1)


def test_draft_repeats_its_period_past_the_end_of_the_tokens() -> None:
    # the earlier [5, 6] is followed by only 3 tokens: the text's period is 3
    p = _proposer(k=5, lo=2, hi=2)
    assert p.propose("r", [5, 6, 7, 5, 6], 5, 5) == [7, 5, 6, 7, 5]
    # periodic text: the earlier occurrence overlaps the suffix (period 1)
    assert p.propose("r2", [1, 1, 1, 1], 4, 5) == [1, 1, 1, 1, 1]


def test_min_n_is_respected() -> None:
    text = [1, 2, 9, 8, 7, 1, 2]  # only the 2-gram [1, 2] repeats
    assert _proposer(k=2, lo=2, hi=4).propose("r", text, 7, 2) == [9, 8]
    assert _proposer(k=2, lo=3, hi=4).propose("r", text, 7, 2) == []


def test_max_n_is_respected_and_the_most_recent_occurrence_wins() -> None:
    # the 3-gram [4, 5, 6] occurs at 1..3 (then 50); its 2-gram tail [5, 6] also at 7..8 (then
    # 60), more recently
    text = [0, 4, 5, 6, 50, 51, 9, 5, 6, 60, 61, 4, 5, 6]
    assert _proposer(k=2, lo=2, hi=3).propose("r", text, 14, 2) == [50, 51]
    assert _proposer(k=2, lo=2, hi=2).propose("r", text, 14, 2) == [60, 61]
    # several copies of the longest match: the most recent one
    text2 = [3, 3, 7, 1, 3, 3, 8, 2, 3, 3]
    assert _proposer(k=2, lo=2, hi=2).propose("r", text2, 10, 2) == [8, 2]


def test_worked_example_of_the_docstring() -> None:
    tokens = np.array([1, 2, 3, 4, 9, 2, 3, 8, 1, 2, 3])
    assert ngram_propose(tokens, 2, 3, 2) == [4, 9]
    assert ngram_propose(tokens, 2, 2, 2) == [8, 1]


def test_vllm_default_lookup_sizes() -> None:
    p = _proposer(k=2)  # neither given: 5 and 5
    assert (p.min_n, p.max_n) == (5, 5)
    four = [1, 2, 3, 4, 99, 1, 2, 3, 4]  # a 4-gram repeat is not enough
    assert p.propose("r", four, 9, 2) == []
    five = [1, 2, 3, 4, 5, 99, 98, 1, 2, 3, 4, 5]
    assert p.propose("r2", five, 12, 2) == [99, 98]


@pytest.mark.parametrize("seed", range(6))
def test_incremental_equals_fresh_equals_reference(seed: int) -> None:
    rng = random.Random(seed)
    vocab = rng.choice([2, 3, 5, 20])
    lo = rng.randint(1, 3)
    hi = rng.randint(lo, 6)
    incremental = _proposer(k=4, lo=lo, hi=hi)
    tokens: list[int] = []
    num_prompt = rng.randint(1, 30)
    while len(tokens) < 300:
        tokens += [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
        if len(tokens) < num_prompt:
            continue
        k = rng.randint(0, 6)
        got = incremental.propose("req", tokens, num_prompt, k)
        fresh = _proposer(k=4, lo=lo, hi=hi).propose("other", list(tokens), num_prompt, k)
        want = _reference(tokens, lo, hi, k)
        assert got == fresh == want, (len(tokens), k)
    incremental.finish("req", tokens, num_prompt)
    assert incremental.num_requests == 0


def test_numpy_and_list_inputs_agree_and_state_restarts_on_rewrite() -> None:
    p = _proposer(k=3, lo=1, hi=3)
    text = [4, 5, 6, 7, 4, 5]
    assert p.propose("a", np.array(text), 6, 3) == p.propose("b", text, 6, 3) == [6, 7, 4]
    # the tokens were rewritten (not a continuation): the proposer starts over
    rewritten = [4, 5, 6, 7, 9, 9, 9, 9, 5]
    assert p.propose("a", rewritten, 6, 3) == _reference(rewritten, 1, 3, 3)
    shorter = [1, 2, 1]
    assert p.propose("a", shorter, 2, 3) == [2, 1, 2]  # period 2
    with pytest.raises(ValueError, match="token_ids"):
        p.propose("bad", [1, "x"], 2, 3)  # type: ignore[list-item]
    assert p.num_requests == 2  # nothing kept for the bad request


def test_256_requests_of_2000_tokens() -> None:
    """The engine's shape (``engine_shape.py``): every draft right, every request dropped."""
    rng = np.random.default_rng(0)
    p = _proposer(k=5, lo=2, hi=5)
    run_engine_shape(p, rng, "ngram")
    assert p.num_requests == 0
