"""Suffix decoding: the tries' counts against brute force (growing, adding and evicting), the
proposer against a plain reference of its rule on random token lists (incrementally and fresh),
the behaviours one by one, and a 256 x 2,000-token run."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest

from pagedllm.spec_decode import SpeculativeConfig, make_proposer
from pagedllm.spec_decode.suffix import SuffixProposer, _CacheTrie, _RequestTrie
from tests.spec_decode.engine_shape import run_engine_shape

Seqs = list[tuple[int, list[int]]]  # (sequence number, tokens), the recency order of the refs


def _proposer(**kw: object) -> SuffixProposer:
    p = make_proposer(SpeculativeConfig.from_dict({"method": "suffix", **kw}))
    assert isinstance(p, SuffixProposer)
    return p


def _occurrences(seqs: Seqs, s: list[int]) -> list[tuple[int, int, list[int]]]:
    n = len(s)
    return [(q, i, seq) for q, seq in seqs for i in range(len(seq) - n + 1) if seq[i : i + n] == s]


def _children(seqs: Seqs, s: list[int], depth: int) -> dict[int, tuple[int, tuple[int, int]]]:
    """token -> (occurrences of s + token, most recent of them) within the depth limit."""
    out: dict[int, tuple[int, tuple[int, int]]] = {}
    if len(s) >= depth:
        return out
    for q, i, seq in _occurrences(seqs, s):
        if i + len(s) < len(seq):
            token = seq[i + len(s)]
            n, recent = out.get(token, (0, (-1, -1)))
            out[token] = (n + 1, max(recent, (q, i)))
    return out


def _reference_draft(
    seqs: Seqs, ctx: list[int], k: int, depth: int, factor: float, min_prob: float
) -> tuple[list[int], float]:
    """The proposer's rule for one tree, by brute force over the sequences."""
    match_len = 0
    for d in range(min(len(ctx), depth - 1), 0, -1):
        if _children(seqs, ctx[len(ctx) - d :], depth):
            match_len = d
            break
    best_m, best_b = 0, 0
    for m in range(1, match_len + 1):
        b = min(k, math.floor(factor * m + 1e-9), depth - m)
        if b >= best_b and b > 0:
            best_m, best_b = m, b
    if best_b == 0:
        return [], 0.0
    s = ctx[len(ctx) - best_m :]
    out: list[int] = []
    prob = 1.0
    while len(out) < best_b:
        children = _children(seqs, s, depth)
        if not children:
            break
        token, (n, _) = max(children.items(), key=lambda kv: kv[1])
        p = prob * n / len(_occurrences(seqs, s))
        if p < min_prob:
            break
        prob = p
        out.append(token)
        s = s + [token]
    return out, prob


def _reference(
    cached: Seqs, ctx: list[int], k: int, depth: int, factor: float, min_prob: float
) -> list[int]:
    own = _reference_draft([(0, ctx)], ctx, k, depth, factor, min_prob)
    other = _reference_draft(cached, ctx, k, depth, factor, min_prob)
    return other[0] if (len(other[0]), other[1]) > (len(own[0]), own[1]) else own[0]


def _all_strings(vocab: int, depth: int) -> list[list[int]]:
    return [list(s) for n in range(1, depth + 1) for s in itertools.product(range(vocab), repeat=n)]


# --- the tries ------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_request_trie_counts_match_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    vocab, depth = rng.choice([(2, 5), (3, 4)])
    trie = _RequestTrie(depth)
    tokens: list[int] = []
    for _ in range(40):
        chunk = [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]
        if rng.random() < 0.3 and len(tokens) > 8:  # copy an earlier passage
            start = rng.randrange(len(tokens) - 4)
            chunk = tokens[start : start + rng.randint(3, 8)]
        trie.extend(chunk)
        tokens += chunk
        for s in _all_strings(vocab, depth):
            assert trie.count(s) == len(_occurrences([(0, tokens)], s)), (tokens, s)
        # active: the suffixes seen at least twice, shorter than the depth, none missing
        want = [
            d
            for d in range(1, min(len(tokens), depth - 1) + 1)
            if len(_occurrences([(0, tokens)], tokens[len(tokens) - d :])) >= 2
        ]
        assert list(range(1, len(trie.active))) == want


@pytest.mark.parametrize("seed", range(5))
def test_cache_trie_counts_match_brute_force_through_adds_and_evictions(seed: int) -> None:
    rng = random.Random(100 + seed)
    vocab, depth = rng.choice([(2, 5), (3, 4)])
    trie = _CacheTrie(depth)
    live: Seqs = []
    seq_no = 0
    versions = {trie.version}
    for _ in range(30):
        if live and (rng.random() < 0.4 or len(live) > 5):
            q, _ = live.pop(0)  # the oldest
            trie.remove(q)
        else:
            tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 14))]
            if live and rng.random() < 0.5:  # share a passage with an earlier one
                other = rng.choice(live)[1]
                tokens = other[: rng.randint(1, len(other))] + tokens
            trie.add(seq_no, tokens)
            live.append((seq_no, tokens))
            seq_no += 1
        versions.add(trie.version)
        for s in _all_strings(vocab, depth):
            assert trie.count(s) == len(_occurrences(live, s)), (live, s)
    while live:
        trie.remove(live.pop(0)[0])
    assert trie.num_nodes == 0 and not trie._edges and not trie.seqs  # nothing leaked
    assert len(versions) == 31  # every change is a new version


# --- the proposer against the reference -----------------------------------------------------


@pytest.mark.parametrize("seed", range(8))
def test_incremental_equals_fresh_equals_reference(seed: int) -> None:
    rng = random.Random(200 + seed)
    vocab = rng.choice([2, 3, 4, 8])
    depth = rng.choice([3, 4, 6, 24])
    factor = rng.choice([0.5, 1.0, 2.0])
    min_prob = rng.choice([0.0, 0.1, 0.34, 0.6])
    max_cached = rng.choice([1, 2, 4])
    kw = {
        "num_speculative_tokens": 8,
        "suffix_decoding_max_tree_depth": depth,
        "suffix_decoding_max_spec_factor": factor,
        "suffix_decoding_min_token_prob": min_prob,
        "suffix_decoding_max_cached_requests": max_cached,
    }
    incremental, fresh = _proposer(**kw), _proposer(**kw)
    cached: Seqs = []
    for r in range(5):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
        tokens = list(prompt)
        for step in range(rng.randint(5, 25)):
            k = rng.randint(0, 8)
            got = incremental.propose(f"r{r}", tokens, len(prompt), k)
            again = fresh.propose(f"r{r}-{step}", tokens, len(prompt), k)
            fresh.finish(f"r{r}-{step}", tokens, len(tokens))  # no output: caches nothing
            want = _reference(cached, tokens, k, depth, factor, min_prob)
            assert got == again == want, (r, step, tokens, k)
            # the "model" accepts part of the draft, then adds a token of its own
            tokens += got[: rng.randint(0, len(got))] + [rng.randrange(vocab)]
        for p in (incremental, fresh):
            p.finish(f"r{r}", tokens, len(prompt))
        cached.append((r, tokens[len(prompt) :]))
        cached = cached[-max_cached:]
        assert incremental.num_cached_requests == len(cached)
    assert incremental.num_requests == 0


# --- behaviours -----------------------------------------------------------------------------


def test_repeated_text_yields_its_continuation() -> None:
    p = _proposer(num_speculative_tokens=4)
    text = [10, 11, 12, 13, 14, 15, 16, 17, 99, 10, 11, 12, 13]
    assert p.propose("r", text, 9, 4) == [14, 15, 16, 17]


def test_no_match_gives_nothing() -> None:
    p = _proposer(num_speculative_tokens=4)
    assert p.propose("r", [1, 2, 3, 4, 5, 6], 6, 4) == []
    assert p.propose("r2", [], 0, 4) == []


def test_k_caps_the_draft() -> None:
    p = _proposer(num_speculative_tokens=16)
    passage = list(range(100, 120))
    text = passage + [1] + passage[:12]  # a 12-token match: up to 24 - 12 tokens follow
    assert p.propose("r", text, 33, 16) == text[12:24]  # (the copy runs into the text after)
    assert p.propose("r", text, 33, 3) == passage[12:15]
    assert p.propose("r", text, 33, 0) == []
    with pytest.raises(ValueError, match="k must be"):
        p.propose("r", text, 33, -2)


def test_a_finished_response_is_proposed_for_a_new_request_with_the_same_start() -> None:
    p = _proposer(num_speculative_tokens=8)
    prompt = [7, 8, 9, 10]
    response = [50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61]
    p.propose("first", prompt, 4, 8)
    p.finish("first", prompt + response, 4)
    assert p.num_requests == 0 and p.num_cached_requests == 1
    # the same prompt again: no output yet, nothing of it in the request's own tokens
    assert p.propose("second", prompt, 4, 8) == []
    # each generated token lengthens the match, and the draft grows with it (spec factor 1)
    assert p.propose("second", prompt + response[:1], 4, 8) == response[1:2]
    assert p.propose("second", prompt + response[:3], 4, 8) == response[3:6]
    assert p.propose("second", prompt + response[:5], 4, 8) == response[5:10]
    # once it diverges the old response is no guide any more
    assert p.propose("second", prompt + response[:5] + [3], 4, 8) == []


def test_min_token_prob_cuts_a_branchy_continuation() -> None:
    # "1 2" was followed by 3, 4 and 5 once each; now the text ends in "1 2" again
    text = [1, 2, 3, 30, 1, 2, 4, 40, 1, 2, 5, 50, 1, 2]
    # 4 occurrences of "1 2" (one is the current end): each branch has probability 1/4
    assert _proposer(suffix_decoding_min_token_prob=0.3).propose("r", text, 14, 4) == []
    # allowed: the most recent branch, then its only continuation (probability 1)
    assert _proposer(suffix_decoding_min_token_prob=0.25).propose("r", text, 14, 4) == [5, 50]
    # a dominant branch passes where the others would not
    text2 = [1, 2, 3, 30, 1, 2, 3, 30, 1, 2, 3, 30, 1, 2, 4, 40, 1, 2]
    assert _proposer(suffix_decoding_min_token_prob=0.5).propose("r", text2, 18, 4) == [3, 30]
    # and the cut falls inside a draft: after "9 1 2" came 3 twice; after "9 1 2 3", 7 and 8
    text3 = [9, 1, 2, 3, 7, 9, 1, 2, 3, 8, 9, 1, 2]
    p = _proposer(suffix_decoding_min_token_prob=0.4)
    assert p.propose("r", text3, 13, 4) == [3]  # 2/3, then 2/3 * 1/2 < 0.4
    p = _proposer(suffix_decoding_min_token_prob=0.3)
    assert p.propose("r", text3, 13, 4) == [3, 8, 9]  # the most recent branch, 3 = m tokens


def test_max_spec_factor_bounds_the_length() -> None:
    passage = list(range(100, 130))
    text = passage + [1] + passage[:6]  # a 6-token match
    for factor, want in [(1.0, 6), (0.5, 3), (0.34, 2), (0.1, 0), (2.0, 10)]:
        p = _proposer(num_speculative_tokens=10, suffix_decoding_max_spec_factor=factor)
        assert p.propose("r", text, 37, 10) == passage[6 : 6 + want], factor


def test_tree_depth_bounds_match_plus_draft() -> None:
    passage = list(range(100, 140))
    text = passage + [1] + passage[:20]
    # depth 8: the best match length m maximizes min(k, m, 8 - m): m = 4, a 4-token draft
    p = _proposer(num_speculative_tokens=10, suffix_decoding_max_tree_depth=8)
    assert p.propose("r", text, 61, 10) == passage[20:24]


def test_ties_go_to_the_most_recent_continuation() -> None:
    text = [1, 2, 3, 1, 2, 4, 1, 2]
    assert _proposer(suffix_decoding_min_token_prob=0.0).propose("r", text, 8, 1) == [4]


def test_lru_cap_on_cached_requests() -> None:
    p = _proposer(num_speculative_tokens=4, suffix_decoding_max_cached_requests=2)
    outputs = {
        name: [base + i for i in range(10)] for name, base in [("a", 100), ("b", 200), ("c", 300)]
    }
    for name, out in outputs.items():
        p.finish(name, [1] + out, 1)
    assert p.num_cached_requests == 2
    # "a" was the least recently finished: evicted; "b" and "c" are still proposed
    assert p.propose("x", [5, 100, 101, 102, 103], 1, 4) == []
    assert p.propose("y", [5, 200, 201, 202, 203], 1, 4) == [204, 205, 206, 207]
    assert p.propose("z", [5, 300, 301, 302, 303], 1, 4) == [304, 305, 306, 307]
    # no global cache at all
    off = _proposer(suffix_decoding_max_cached_requests=0)
    off.finish("a", [1] + outputs["a"], 1)
    assert off.num_cached_requests == 0
    assert off.propose("x", [5, 100, 101, 102, 103], 1, 4) == []


def test_a_rewritten_request_starts_over() -> None:
    p = _proposer(num_speculative_tokens=4)
    p.propose("r", [1, 2, 3, 4, 1, 2], 6, 4)
    rewritten = [7, 8, 9, 7, 8]  # not a continuation of what the proposer saw
    assert p.propose("r", rewritten, 5, 4) == _proposer().propose("fresh", rewritten, 5, 4)
    assert p.propose("r", rewritten, 5, 4) == [9, 7]
    with pytest.raises(ValueError, match="token_ids"):
        p.propose("bad", [1, -2, 3], 3, 2)
    assert p.num_requests == 1  # nothing kept for the bad request
    with pytest.raises(ValueError, match="num_prompt_tokens"):
        p.finish("r", rewritten, 9)
    assert p.num_requests == 0 and p.num_cached_requests == 0  # dropped, nothing cached


def test_256_requests_of_2000_tokens() -> None:
    """The engine's shape (``engine_shape.py``) beside a global trie of 64 finished outputs:
    every draft right, every request's output cached at its end."""
    rng = np.random.default_rng(0)
    p = _proposer(num_speculative_tokens=5)
    for i in range(64):
        p.finish(f"done{i}", rng.integers(0, 32000, 600).tolist(), 100)
    run_engine_shape(p, rng, "suffix")
    assert p.num_requests == 0 and p.num_cached_requests == 64 + 256
