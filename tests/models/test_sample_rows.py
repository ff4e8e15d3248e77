"""Rows that draw several samples: a request verifying draft tokens samples at each of its
k + 1 positions (runner level, tiny random llama, fp32), and a request with n > 1 sequences
draws its forks inside the sampler under the seeding rule of core/sched/groups.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.config import EngineArgs
from pagedllm.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from pagedllm.sample.sampler import Sampler
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.model_runner import ModelRunner
from pagedllm.worker.sampling_inputs import build_sampling_metadata
from tests.models.tiny import hf_greedy

BLOCK = 16


@pytest.fixture(scope="module")
def runner_factory(tiny_models):
    path = tiny_models("llama")
    config = EngineArgs(
        model=path, dtype="float32", max_model_len=128, device="cpu", block_size=BLOCK
    ).create_engine_config()

    def make() -> ModelRunner:
        runner = ModelRunner(config)
        runner.initialize_kv_cache(32, log=False)
        return runner

    return path, make


def _prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 500, size=n).tolist()


def _step(
    runner: ModelRunner,
    scheduled: dict[str, int],
    new: list[NewRequestData] | None = None,
    cached: list[CachedRequestData] | None = None,
    spec: dict[str, list[int]] | None = None,
) -> dict[str, tuple[list[int], list | None]]:
    """Run one hand-made step; per request: (its samples, its logprob triples or None)."""
    so = SchedulerOutput(
        scheduled_new_reqs=new or [],
        scheduled_cached_reqs=cached or [],
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()),
        scheduled_spec_tokens=spec or {},
    )
    out = runner.execute_model(so)
    lps = out.logprobs or [None] * len(out.req_ids)
    return {r: (t, lp) for r, t, lp in zip(out.req_ids, out.sampled_token_ids, lps)}


def _new(rid: str, prompt: list[int], params: SamplingParams, first_block: int) -> NewRequestData:
    # two blocks per request: positions 0..31 (one KV-cache group)
    blocks = [first_block, first_block + 1]
    return NewRequestData(rid, prompt, [], params, (blocks,), 0)


def _cached(rid: str, computed: int, append: list[int] | None = None) -> CachedRequestData:
    return CachedRequestData(rid, (), computed, [], append or [])


def test_drafts_sample_every_position_and_commit_only_the_first(runner_factory):
    path, make = runner_factory
    runner = make()
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = {"a": _prompt(20, 0), "b": _prompt(13, 1), "c": _prompt(9, 2)}
    late = _prompt(11, 4)  # a prompt prefilled beside the drafts: not every token samples
    ref = dict(zip([*prompts, "d"], hf_greedy(path, [*prompts.values(), late], 6)[0]))
    new = [_new(rid, p, greedy, 2 * i) for i, (rid, p) in enumerate(prompts.items())]
    lens = {rid: len(p) for rid, p in prompts.items()}

    out = _step(runner, dict(lens), new=new)
    assert {rid: t for rid, (t, _) in out.items()} == {rid: ref[rid][:1] for rid in prompts}

    # a: the true continuation as drafts; b: a wrong first draft; c: a plain decode
    wrong = (ref["b"][1] + 1) % 500
    spec = {"a": ref["a"][1:4], "b": [wrong, ref["b"][2]]}
    cached = [_cached(rid, lens[rid]) for rid in prompts]
    scheduled = {"a": 4, "d": 11, "b": 3, "c": 1}
    out = _step(runner, scheduled, [_new("d", late, greedy, 6)], cached, spec)
    assert out["a"][0] == ref["a"][1:5]  # k + 1 samples: each the greedy token there
    assert len(out["b"][0]) == 3 and out["b"][0][0] == ref["b"][1]
    assert out["c"][0] == ref["c"][1:2]
    assert out["d"][0] == ref["d"][:1]
    ib = runner.input_batch
    for rid in prompts:  # only the first sample is committed; no draft leaks in
        row = ib.req_id_to_row[rid]
        assert ib.num_tokens[row] == lens[rid] + 2
        assert ib.output_ids(row) == ref[rid][:2]
        assert ib.prompt_ids(row) == prompts[rid]

    # The scheduler's part (SchedulerOutput.scheduled_spec_tokens): a accepts all 3 drafts,
    # b none; the next step carries the computed counts and the accepted tokens
    cached = [
        _cached("a", lens["a"] + 1 + 3, ref["a"][2:5]),
        _cached("b", lens["b"] + 1),
        _cached("c", lens["c"] + 1),
    ]
    out = _step(runner, {"a": 1, "b": 1, "c": 1}, cached=cached)
    assert out["a"][0] == ref["a"][5:6]
    assert out["b"][0] == ref["b"][2:3]
    assert out["c"][0] == ref["c"][2:3]
    assert ib.output_ids(ib.req_id_to_row["a"]) == ref["a"][:6]


def test_drafts_sample_like_plain_decodes_with_seeds_and_logprobs(runner_factory):
    """Sample j of a row with drafts uses the request's seed at output position j (and its
    penalties see the drafts before it): with the true continuation as drafts, a seeded
    random request samples exactly what its plain decodes sampled."""
    _, make = runner_factory
    runner = make()
    params = SamplingParams(
        temperature=1.0, seed=7, top_k=50, repetition_penalty=1.3, logprobs=2, max_tokens=16
    )
    prompt = _prompt(18, 3)
    plain: list[int] = []
    plain_lps: list = []
    t, lp = _step(runner, {"p": 18}, new=[_new("p", prompt, params, 0)])["p"]
    plain += t
    for i in range(4):
        t, lp = _step(runner, {"p": 1}, cached=[_cached("p", 18 + i)])["p"]
        plain += t
        plain_lps += lp

    t, _ = _step(runner, {"q": 18}, new=[_new("q", prompt, params, 2)])["q"]
    assert t == plain[:1]
    t, lp = _step(runner, {"q": 4}, cached=[_cached("q", 18)], spec={"q": plain[1:4]})["q"]
    assert t == plain[1:5]
    assert len(lp) == 4 and [x[0][0] for x in lp] == t  # column 0: the sampled token
    for got, want in zip(lp, plain_lps):
        assert got[0] == want[0] and got[2] == want[2]
        assert got[1] == pytest.approx(want[1], abs=1e-4)


def test_draft_positions_repeat_their_rows_parameters():
    """A row verifying drafts [8, 9] after output [7] samples at output positions 1, 2, 3
    with its seed each time, its penalties seeing the drafts before each position and its
    min_tokens mask where the position is still under min_tokens."""
    ib = InputBatch(max_num_reqs=4, max_model_len=64, block_size=BLOCK)
    params = SamplingParams(temperature=1.0, seed=5, presence_penalty=0.5, min_tokens=3)
    plain = SamplingParams(temperature=0)
    ib.add_request(NewRequestData("p", [4, 5], [], plain, (), 0))
    ib.add_request(NewRequestData("s", [4, 5, 6], [7], params, (), 0))
    rows = np.array([ib.req_id_to_row["p"], ib.req_id_to_row["s"]])
    gen = torch.Generator().manual_seed(0)
    md = build_sampling_metadata(ib, rows, torch.device("cpu"), gen, {2}, [[], [8, 9]])
    assert md.output_positions == [0, 1, 2, 3]
    assert md.seeds == [None, 5, 5, 5]
    assert md.output_ids == [[], [7], [7, 8], [7, 8, 9]]
    assert md.prompt_ids == [[4, 5], [4, 5, 6], [4, 5, 6], [4, 5, 6]]
    assert [i for i, _ in md.min_tokens_masks] == [1, 2]  # outputs 1, 2 < min_tokens 3
    assert md.temperature.tolist() == [0.0, 1.0, 1.0, 1.0] and md.fork_counts is None


def test_forks_are_extra_samples_of_one_row_under_the_seed_rule():
    """A row of a request with n = 4 at output 0 draws 3 extra samples from its logits in one
    sampler call; extra sample i equals a lone row with seed s + i. Rows past output 0 (or with
    n = 1) draw none."""
    ib = InputBatch(max_num_reqs=8, max_model_len=64, block_size=BLOCK)
    base = dict(temperature=1.0, top_p=0.9, logprobs=1, max_tokens=8)
    rows = {}
    for rid, params, out in [
        ("fork", SamplingParams(seed=11, n=4, **base), []),
        ("plain", SamplingParams(seed=5, **base), []),
        ("late", SamplingParams(seed=3, n=2, **base), [7]),  # past output 0: no forks
        ("fork2", SamplingParams(seed=20, n=2, **base), []),
    ]:
        rows[rid] = ib.add_request(NewRequestData(rid, [4, 5, 6], out, params, (), 0))
    sample_rows = np.array([rows[r] for r in ("fork", "plain", "late", "fork2")])
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(0)
    md = build_sampling_metadata(ib, sample_rows, torch.device("cpu"), gen, set())
    assert md.fork_counts is not None and md.fork_counts.tolist() == [3, 0, 0, 1]
    out = Sampler()(logits, md)
    assert out.sampled.shape == (4,) and out.logprob_ids.shape == (4, 2)
    assert out.forks is not None and out.forks.sampled.shape == (4,)

    def alone(row: int, seed: int) -> tuple[int, float]:
        p = SamplingParams(seed=seed, **base)
        single = InputBatch(max_num_reqs=1, max_model_len=64, block_size=BLOCK)
        single.add_request(NewRequestData("x", [4, 5, 6], [], p, (), 0))
        md1 = build_sampling_metadata(single, np.array([0]), torch.device("cpu"), gen, set())
        o = Sampler()(logits[row : row + 1], md1)
        return int(o.sampled[0]), float(o.logprobs[0, 0])

    expect = [alone(0, 12), alone(0, 13), alone(0, 14), alone(3, 21)]
    got = list(zip(out.forks.sampled.tolist(), out.forks.logprobs[:, 0].tolist()))
    for (tok, lp), (etok, elp) in zip(got, expect):
        assert tok == etok and lp == pytest.approx(elp, abs=1e-6)
    assert (int(out.sampled[0]), float(out.logprobs[0, 0])) == pytest.approx(alone(0, 11))
