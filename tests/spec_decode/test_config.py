"""SpeculativeConfig: vLLM's keys and defaults, errors that name the field, the JSON round trip,
and make_proposer."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pagedllm.spec_decode import (
    MAX_NUM_SPECULATIVE_TOKENS,
    Proposer,
    SpeculativeConfig,
    make_proposer,
)
from pagedllm.spec_decode.draft_model import DraftModelProposals
from pagedllm.spec_decode.ngram import NgramProposer
from pagedllm.spec_decode.suffix import SuffixProposer


def test_ngram_defaults_are_vllms() -> None:
    both = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert (both.prompt_lookup_min, both.prompt_lookup_max) == (5, 5)
    only_max = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    )
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (4, 4)
    only_min = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}
    )
    assert (only_min.prompt_lookup_min, only_min.prompt_lookup_max) == (2, 2)
    given = SpeculativeConfig.from_dict(
        {
            "method": "ngram",
            "num_speculative_tokens": 7,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 6,
        }
    )
    assert (given.num_speculative_tokens, given.prompt_lookup_min, given.prompt_lookup_max) == (
        7,
        1,
        6,
    )


def test_suffix_defaults_are_vllms() -> None:
    c = SpeculativeConfig.from_dict({"method": "suffix"})
    assert c.suffix_decoding_max_tree_depth == 24
    assert c.suffix_decoding_max_cached_requests == 10000
    assert c.suffix_decoding_max_spec_factor == 1.0
    assert c.suffix_decoding_min_token_prob == 0.1
    # k defaults to the tree depth (vLLM), within the engine's cap
    assert c.num_speculative_tokens == min(24, MAX_NUM_SPECULATIVE_TOKENS)
    shallow = SpeculativeConfig.from_dict({"method": "suffix", "suffix_decoding_max_tree_depth": 6})
    assert shallow.num_speculative_tokens == 6
    explicit = SpeculativeConfig.from_dict({"method": "suffix", "num_speculative_tokens": 4})
    assert explicit.num_speculative_tokens == 4
    ints = SpeculativeConfig.from_dict(
        {
            "method": "suffix",
            "suffix_decoding_max_spec_factor": 2,
            "suffix_decoding_min_token_prob": 0,
        }
    )
    assert isinstance(ints.suffix_decoding_max_spec_factor, float)
    assert isinstance(ints.suffix_decoding_min_token_prob, float)


def test_draft_model_needs_a_model_and_a_model_alone_means_draft_model() -> None:
    c = SpeculativeConfig.from_dict(
        {"method": "draft_model", "model": "/models/draft", "num_speculative_tokens": 4}
    )
    assert (c.method, c.model) == ("draft_model", "/models/draft")
    inferred = SpeculativeConfig.from_dict({"model": "/models/draft", "num_speculative_tokens": 2})
    assert inferred.method == "draft_model"


@pytest.mark.parametrize(
    "d, field",
    [
        ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup": 2}, "prompt_lookup"),
        ({"method": "eagle", "num_speculative_tokens": 3}, "method"),
        ({"method": "[ngram]", "num_speculative_tokens": 3}, "method"),
        ({"num_speculative_tokens": 3}, "method"),
        ({"method": 5, "num_speculative_tokens": 3}, "method"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "draft_model", "model": "m"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": "3"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 3.0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
        ({"method": "suffix", "num_speculative_tokens": -1}, "num_speculative_tokens"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 3,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 2,
            },
            "prompt_lookup_min",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 0},
            "prompt_lookup_min",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": "4"},
            "prompt_lookup_max",
        ),
        ({"method": "draft_model", "num_speculative_tokens": 3}, "model"),
        ({"method": "draft_model", "num_speculative_tokens": 3, "model": ""}, "model"),
        ({"method": "draft_model", "num_speculative_tokens": 3, "model": 7}, "model"),
        ({"method": "ngram", "num_speculative_tokens": 3, "model": "m"}, "model"),
        ({"method": "suffix", "prompt_lookup_max": 3}, "prompt_lookup_max"),
        (
            {"method": "ngram", "num_speculative_tokens": 3, "suffix_decoding_max_tree_depth": 8},
            "suffix_decoding_max_tree_depth",
        ),
        (
            {"method": "suffix", "suffix_decoding_max_tree_depth": 0},
            "suffix_decoding_max_tree_depth",
        ),
        (
            {"method": "suffix", "suffix_decoding_max_tree_depth": 2.5},
            "suffix_decoding_max_tree_depth",
        ),
        (
            {"method": "suffix", "suffix_decoding_max_cached_requests": -1},
            "suffix_decoding_max_cached_requests",
        ),
        (
            {"method": "suffix", "suffix_decoding_max_spec_factor": -0.5},
            "suffix_decoding_max_spec_factor",
        ),
        (
            {"method": "suffix", "suffix_decoding_max_spec_factor": float("nan")},
            "suffix_decoding_max_spec_factor",
        ),
        (
            {"method": "suffix", "suffix_decoding_min_token_prob": 1.5},
            "suffix_decoding_min_token_prob",
        ),
        (
            {"method": "suffix", "suffix_decoding_min_token_prob": "0.1"},
            "suffix_decoding_min_token_prob",
        ),
        ({"method": "suffix", "disable_by_batch_size": 1}, "disable_by_batch_size"),
        ({"method": "suffix", "disable_by_batch_size": 8.0}, "disable_by_batch_size"),
        ({"method": "suffix", "disable_when_slower": "yes"}, "disable_when_slower"),
        ({"method": "suffix", "disable_when_slower": 1}, "disable_when_slower"),
    ],
)
def test_errors_name_the_field(d: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.from_dict(d)


def test_not_a_dict_or_not_json() -> None:
    with pytest.raises(ValueError, match="speculative_config"):
        SpeculativeConfig.from_dict([("method", "ngram")])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not valid JSON"):
        SpeculativeConfig.from_json('{"method": "ngram",')
    c = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 2}')
    assert c.num_speculative_tokens == 2


def test_direct_construction_is_checked_too() -> None:
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=3)  # from_dict fills these
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(method="suffix", num_speculative_tokens=0)


@pytest.mark.parametrize(
    "d",
    [
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3},
        {
            "method": "suffix",
            "suffix_decoding_max_tree_depth": 12,
            "suffix_decoding_max_spec_factor": 0.5,
            "suffix_decoding_min_token_prob": 0.2,
            "suffix_decoding_max_cached_requests": 7,
        },
        {"method": "draft_model", "model": "some/draft", "num_speculative_tokens": 3},
        {"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 16},
        {"method": "suffix", "disable_when_slower": True},
    ],
)
def test_json_round_trip(d: dict) -> None:
    c = SpeculativeConfig.from_dict(d)
    back = SpeculativeConfig.from_dict(json.loads(json.dumps(c.to_dict())))
    assert back == c
    assert SpeculativeConfig.from_json(json.dumps(c.to_dict())) == c


def test_frozen() -> None:
    c = SpeculativeConfig.from_dict({"method": "suffix"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.num_speculative_tokens = 3  # type: ignore[misc]


def test_make_proposer() -> None:
    ngram = make_proposer(
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2})
    )
    suffix = make_proposer(SpeculativeConfig.from_dict({"method": "suffix"}))
    draft = make_proposer(SpeculativeConfig.from_dict({"model": "d", "num_speculative_tokens": 2}))
    assert isinstance(ngram, NgramProposer) and isinstance(ngram, Proposer)
    assert isinstance(suffix, SuffixProposer) and isinstance(suffix, Proposer)
    assert isinstance(draft, DraftModelProposals) and isinstance(draft, Proposer)
