"""Speculative decoding end to end on tiny random models (fp32; the CPU here, CUDA where
there is a GPU): the tokens and the sampling distribution are those without it (issue 19).

- Greedy: identical outputs with and without speculation, n-gram (on the host, and on the
  device with async scheduling: ngram_gpu), suffix and draft-model proposers, every
  architecture, and with chunked prefill, prefix caching, preemption, n > 1,
  priorities, async scheduling asked for, structured requests in the batch, stop strings,
  logprobs. The draft models are the target with noise added to its weights (they agree on
  many greedy tokens, not all), or another architecture with other KV shapes.
- Seeded sampling: a request with a seed draws each position's noise from (seed, position),
  so with speculation it gives the very same tokens at temperature 1 / top-p 0.9.
- Distribution: unseeded sampling at temperature 1 / top-p 0.9, 10,000 requests with and
  without speculation (a good proposer and a deliberately bad one): a two-sample chi-square
  test over the most frequent 3-token outputs finds no difference.
"""

from __future__ import annotations

import numpy as np
import pytest

from pagedllm import LLM, SamplingParams

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma3"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
# the same lookup on the device, with async scheduling (what it is for: every step async)
NGRAM_GPU = {"method": "ngram_gpu", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 4}
DRAFT_NOISE = 0.005  # a draft model's weights: the target's + N(0, this); theirs are ~0.08


@pytest.fixture(scope="module")
def draft_of(tiny_models, tmp_path_factory):  # noqa: ANN001, ANN201
    """arch -> a speculative_config with a draft model for that architecture's tiny model."""
    from tests.models.tiny import make_perturbed_copy

    root = tmp_path_factory.mktemp("drafts")
    cache: dict[str, dict] = {}

    def get(arch: str, k: int = 3) -> dict:
        if arch not in cache:
            path = make_perturbed_copy(tiny_models(arch), str(root / arch), DRAFT_NOISE)
            cache[arch] = {"method": "draft_model", "model": path}
        return {**cache[arch], "num_speculative_tokens": k}

    return get


def _prompts(n: int = 6, seed: int = 0) -> list[dict]:
    """Prompts that repeat a phrase, so proposers find matches."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        phrase = rng.integers(3, 500, int(rng.integers(5, 14))).tolist()
        out.append({"prompt_token_ids": phrase * 3 + phrase[: i + 1]})
    return out


def _tokens(
    llm: LLM, prompts: list, params: list | SamplingParams, **kw: object
) -> list[list[list[int]]]:
    outs = llm.generate(prompts, params, use_tqdm=False, **kw)
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


def _spec_stats(llm: LLM) -> dict:
    return {m.name: m for m in llm.get_metrics()}


def _engine(path: str, **kw) -> LLM:
    # the CPU here; on a GPU machine the same tests run on CUDA (graphs for plain decode
    # steps, eager verification steps)
    kw.setdefault("kv_cache_memory_bytes", 32 << 20)  # several engines live at once on a GPU
    return LLM(path, dtype="float32", device="auto", max_model_len=256, **kw)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_outputs_equal_every_arch(tiny_models, draft_of, arch: str) -> None:  # noqa: ANN001
    path = tiny_models(arch)
    prompts = _prompts()
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = _tokens(_engine(path), prompts, sp)
    for spec in (NGRAM, SUFFIX, draft_of(arch), NGRAM_GPU):
        kw = {"async_scheduling": True} if spec is NGRAM_GPU else {}
        llm = _engine(path, speculative_config=spec, **kw)
        assert _tokens(llm, prompts, sp) == want, spec["method"]
        if spec is NGRAM_GPU:  # drafts never went through the host: every step async
            core = llm.llm_engine.engine_core
            assert core.num_async_steps == core.num_steps > 0
        m = _spec_stats(llm)
        # the repeated phrases make drafts that are accepted: speculation really ran
        assert m["vllm:spec_decode_num_drafts"].value > 0
        assert m["vllm:spec_decode_num_accepted_tokens"].value > 0
        assert m["pagedllm:spec_decode_mean_acceptance_length"].value > 1.0


@pytest.mark.parametrize(
    "engine_kw",
    [
        {"max_num_batched_tokens": 16},  # chunked prefill, and drafts cut by the budget
        {"enable_prefix_caching": True},  # shared prefixes hit the cache
        {"num_gpu_blocks_override": 14, "block_size": 4},  # preemption by recompute
        {"scheduling_policy": "priority"},
        {"async_scheduling": True},  # asked for: speculation runs synchronous steps
    ],
    ids=["chunked", "prefix", "preempt", "priority", "async"],
)
def test_greedy_outputs_equal_with_engine_features(tiny_models, draft_of, engine_kw: dict) -> None:  # noqa: ANN001
    path = tiny_models("llama")
    prompts = _prompts(8)
    shared = prompts[0]["prompt_token_ids"]
    prompts += [{"prompt_token_ids": shared + p["prompt_token_ids"][:7]} for p in prompts[:4]]
    sp = [
        SamplingParams(temperature=0, max_tokens=24 + i % 3, ignore_eos=True)
        for i in range(len(prompts))
    ]
    priority = list(range(len(prompts)))[::-1]
    kw = {"priority": priority} if engine_kw.get("scheduling_policy") == "priority" else {}
    want = _tokens(_engine(path, **engine_kw), prompts, sp, **kw)
    for spec in (NGRAM, SUFFIX, draft_of("llama"), NGRAM_GPU):
        # ngram_gpu with async scheduling: its steps are planned before the last step's
        # drafts are verified (preempted, chunked, cached meanwhile)
        more = {"async_scheduling": True} if spec is NGRAM_GPU else {}
        llm = _engine(path, speculative_config=spec, **{**engine_kw, **more})
        assert _tokens(llm, prompts, sp, **kw) == want, spec["method"]
        assert _spec_stats(llm)["vllm:spec_decode_num_accepted_tokens"].value > 0
        core = llm.llm_engine.engine_core
        if "num_gpu_blocks_override" in engine_kw:
            assert core.scheduler.num_preemptions > 0, "the case meant to preempt did not"
        core.check_integrity()


def test_greedy_parallel_sampling_logprobs_and_limits(tiny_models, draft_of) -> None:  # noqa: ANN001
    """n > 1 (seeded forks), logprobs of every token, max_tokens and min_tokens, and a stop
    token id: exactly as without speculation."""
    path = tiny_models("qwen2")
    prompts = _prompts(5, seed=1)
    base = _engine(path)
    ref = base.generate(prompts, SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)
    stop_id = ref[1].outputs[0].token_ids[12]  # a token the greedy output meets
    params = [
        SamplingParams(temperature=0, max_tokens=30, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_id]),
        SamplingParams(temperature=0.8, n=3, seed=11, max_tokens=17, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=9, min_tokens=9),
        # penalties read the drafts as output (ngram_gpu: none for it; the others' beside it)
        SamplingParams(temperature=0, max_tokens=20, presence_penalty=0.5, ignore_eos=True),
    ]
    want = base.generate(prompts, params, use_tqdm=False)
    for spec in (NGRAM, SUFFIX, draft_of("qwen2"), NGRAM_GPU):
        # (ngram_gpu: the seeded forks and min_tokens draft nothing until they may)
        kw = {"async_scheduling": True} if spec is NGRAM_GPU else {}
        llm = _engine(path, speculative_config=spec, **kw)
        got = llm.generate(prompts, params, use_tqdm=False)
        for w, g in zip(want, got):
            assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
            assert [c.finish_reason for c in g.outputs] == [c.finish_reason for c in w.outputs]
        lp_w, lp_g = want[0].outputs[0].logprobs, got[0].outputs[0].logprobs
        assert lp_w is not None and lp_g is not None and len(lp_g) == len(lp_w) == 30
        for a, b in zip(lp_w, lp_g):
            assert a.keys() == b.keys()
            for tok in a:
                assert b[tok].logprob == pytest.approx(a[tok].logprob, abs=1e-4)
                assert b[tok].rank == a[tok].rank
    assert want[1].outputs[0].finish_reason == "stop"


def test_speculation_pauses_under_load(tiny_models) -> None:
    """``disable_by_batch_size`` 2: while two or more requests run, steps propose nothing
    (and may run asynchronously); the request left alone speculates again. Tokens are those
    without speculation."""
    path = tiny_models("llama")
    prompts = _prompts(4)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (40, 8, 8, 8)]
    want = _tokens(_engine(path), prompts, params)
    drafted = {}
    for limit in (2, 100):
        spec = {**NGRAM, "disable_by_batch_size": limit}
        llm = _engine(path, speculative_config=spec, async_scheduling=True)
        assert _tokens(llm, prompts, params) == want, limit
        drafted[limit] = _spec_stats(llm)["vllm:spec_decode_num_draft_tokens"].value
    # the long request drafts once alone; with no pause every request drafts from the start
    assert 0 < drafted[2] < drafted[100]


def _stop_string_case(path: str, n: int, seed: int, at: int) -> tuple[list, list, list]:
    """Prompts, params with a stop string cut from each greedy output at ``at`` (3
    characters), and the outputs without speculation."""
    prompts = _prompts(n, seed=seed)
    base = _engine(path)
    ref = base.generate(prompts, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    stops = [o.outputs[0].text[at : at + 3] or "zz" for o in ref]
    params = [
        SamplingParams(temperature=0, max_tokens=40, stop=[s], ignore_eos=True) for s in stops
    ]
    return prompts, params, base.generate(prompts, params, use_tqdm=False)


def test_stop_string_ends_where_it_would(tiny_models) -> None:
    """A stop string found in a step that accepted several tokens ends the output at the
    same text as without speculation."""
    path = tiny_models("llama")
    prompts, params, want = _stop_string_case(path, 3, seed=2, at=10)
    got = _engine(path, speculative_config=NGRAM).generate(prompts, params, use_tqdm=False)
    for w, g in zip(want, got):
        assert g.outputs[0].text == w.outputs[0].text
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason


def test_output_processing_overlaps_speculating_steps(tiny_models) -> None:
    """With async scheduling, a speculating (synchronous) step detokenizes the last step's
    outputs while the device computes it, as asynchronous steps do: stop strings then end
    the outputs at the same text, and the request a stop string ends in flight loses only
    the extra step's tokens (its blocks are freed once)."""
    path = tiny_models("llama")
    prompts, params, want = _stop_string_case(path, 4, seed=3, at=12)
    llm = _engine(path, speculative_config=NGRAM, async_scheduling=True)
    engine = llm.llm_engine
    runner = engine.engine_core.model_runner
    in_flight: list[bool] = []  # per output processing: a step on the device meanwhile
    process = engine._process

    def spy(core_outputs: list) -> list:
        if core_outputs:
            in_flight.append(runner._unresolved is not None)
        return process(core_outputs)

    engine._process = spy
    got = llm.generate(prompts, params, use_tqdm=False)
    for w, g in zip(want, got):
        assert g.outputs[0].text == w.outputs[0].text
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
    assert _spec_stats(llm)["vllm:spec_decode_num_draft_tokens"].value > 0  # it speculated
    assert sum(in_flight) >= len(in_flight) // 2  # most outputs were processed in flight
    engine.engine_core.check_integrity()


def _phrases_schema(n: int) -> dict:
    """A JSON array of exactly ``n`` of two phrases: outputs that repeat, drafts that hit."""
    return {
        "type": "array",
        "items": {"type": "string", "enum": ["hello world", "good night"]},
        "minItems": n,
        "maxItems": n,
    }


@pytest.mark.parametrize("grammar_process", [False, True], ids=["in-loop", "worker"])
def test_structured_requests_speculate(tiny_models, draft_of, grammar_process: bool) -> None:  # noqa: ANN001
    """Requests with a grammar verify drafts too (a bitmask row per position): their outputs
    are those without speculation and follow their grammars, and drafts were accepted in a
    batch of structured requests only."""
    pytest.importorskip("xgrammar")
    import json

    from pagedllm.sampling_params import StructuredOutputsParams

    path = tiny_models("llama")
    prompts = _prompts(3, seed=3)
    repeat = _phrases_schema(4)
    params = [
        SamplingParams(
            temperature=0,
            max_tokens=200,
            structured_outputs=StructuredOutputsParams(json=repeat, disable_any_whitespace=True),
        ),
        SamplingParams(
            temperature=0,
            max_tokens=20,
            structured_outputs=StructuredOutputsParams(choice=["alpha", "beta", "gamma"]),
        ),
        SamplingParams(
            temperature=0.7,
            seed=5,
            max_tokens=60,
            structured_outputs=StructuredOutputsParams(regex=r"(ab|cd){4,12}"),
        ),
    ]
    kw = {"grammar_process": grammar_process}
    want = _engine(path, **kw).generate(prompts, params, use_tqdm=False)
    for spec in (NGRAM, draft_of("llama")):
        llm = _engine(path, speculative_config=spec, **kw)
        got = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        assert got[0].outputs[0].finish_reason == "stop", got[0].outputs[0].text
        assert len(json.loads(got[0].outputs[0].text)) == 4
        assert got[1].outputs[0].text in ("alpha", "beta", "gamma")
        m = _spec_stats(llm)
        # the draft model drafts without the grammar (its greedy tokens here are rarely
        # allowed ones): its drafts are verified, the n-gram ones accepted too
        key = "accepted_tokens" if spec is NGRAM else "draft_tokens"
        assert m[f"vllm:spec_decode_num_{key}"].value > 0, spec["method"]


def test_ngram_gpu_beside_structured_requests(tiny_models) -> None:
    """ngram_gpu with async scheduling and structured requests in the batch: those draft
    nothing (their bitmask covers each position; the host does not know the device's
    drafts), the others verify device drafts in the same steps; every output is the one
    without speculation and the structured ones follow their grammars."""
    pytest.importorskip("xgrammar")
    import json

    from pagedllm.sampling_params import StructuredOutputsParams

    path = tiny_models("llama")
    prompts = _prompts(4, seed=6)
    structured = StructuredOutputsParams(json=_phrases_schema(3), disable_any_whitespace=True)
    params = [
        SamplingParams(temperature=0, max_tokens=120, structured_outputs=structured),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
        SamplingParams(
            temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(regex="(ab)+")
        ),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
    ]
    want = _engine(path, async_scheduling=True).generate(prompts, params, use_tqdm=False)
    llm = _engine(path, speculative_config=NGRAM_GPU, async_scheduling=True)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert len(json.loads(got[0].outputs[0].text)) == 3
    assert _spec_stats(llm)["vllm:spec_decode_num_accepted_tokens"].value > 0
    core = llm.llm_engine.engine_core
    assert core.num_async_steps == core.num_steps


def test_seeded_sampling_is_reproduced_exactly(tiny_models, draft_of) -> None:  # noqa: ANN001
    """Temperature 1, top-p 0.9, a seed per request: the same tokens with speculation, since
    each output position draws the same noise and the same target distribution."""
    path = tiny_models("qwen3")
    prompts = _prompts(6, seed=4)
    params = [
        SamplingParams(temperature=1.0, top_p=0.9, seed=100 + i, max_tokens=32, ignore_eos=True)
        for i in range(len(prompts))
    ]
    want = _tokens(_engine(path), prompts, params)
    for spec in (NGRAM, SUFFIX, draft_of("qwen3")):
        assert _tokens(_engine(path, speculative_config=spec), prompts, params) == want
    # ngram_gpu drafts nothing for a seeded request (its noise is drawn by output position,
    # which the host does not know under async scheduling): the same tokens, async steps
    llm = _engine(path, speculative_config=NGRAM_GPU, async_scheduling=True)
    assert _tokens(llm, prompts, params) == want


class _FixedProposer:
    """Proposes the same tokens every step (a deliberately bad draft when they are unlikely)."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def propose(self, req_id: str, token_ids: list[int], num_prompt_tokens: int, k: int):
        return self.tokens[:k]

    def finish(self, req_id: str, token_ids: list[int], num_prompt_tokens: int) -> None:
        pass


def _peaky_model(path: str, out: str) -> str:
    """The tiny model with its LM head scaled 6x: distributions with a few likely tokens (top
    probability ~0.4), so 3-token outputs repeat often enough to compare frequencies."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(path, out)
    tensors = load_file(f"{out}/model.safetensors")
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * 6.0
    save_file(tensors, f"{out}/model.safetensors", metadata={"format": "pt"})
    return out


def _chi_square_two_sample(a: list[tuple], b: list[tuple], bins: int = 10) -> float:
    """The two-sample (homogeneity) chi-square statistic over the ``bins - 1`` most frequent
    values of both samples and one bin for the rest."""
    from collections import Counter

    ca, cb = Counter(a), Counter(b)
    top = [v for v, _ in (ca + cb).most_common(bins - 1)]
    na, nb = len(a), len(b)
    obs_a = [ca[v] for v in top] + [na - sum(ca[v] for v in top)]
    obs_b = [cb[v] for v in top] + [nb - sum(cb[v] for v in top)]
    stat = 0.0
    for x, y in zip(obs_a, obs_b):
        total = x + y
        ea, eb = total * na / (na + nb), total * nb / (na + nb)
        stat += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
    return stat


# chi-square critical value, 9 degrees of freedom, alpha = 0.001
CHI2_9_999 = 27.877


def _fixed_device_drafts(tokens: list[int]):  # noqa: ANN202
    """A stand-in for ``DeviceDrafts.verify`` that verifies as it does (on the GPU, the
    Triton kernel) and then, in place of the lookup, gives every row ``tokens`` as drafts."""
    import torch

    from pagedllm.worker.device_drafts import DeviceDrafts

    verify = DeviceDrafts.verify

    def fixed(self, samples, rows, first, ks, batch_idx, seq_lens, used, valid, width,  # noqa: ANN001, ANN202
              lookup=True):  # noqa: ANN001  # fmt: skip
        bonus, found = verify(self, samples, rows, first, ks, batch_idx, seq_lens, used, valid,
                              width, False)  # fmt: skip
        row = (tokens + [0] * self.k)[: self.k]
        self.drafts[:] = torch.tensor(row, dtype=self.drafts.dtype, device=self.drafts.device)
        self.num_valid[:] = min(self.k, len(tokens))
        return bonus, torch.full_like(found, min(self.k, len(tokens)))

    return fixed


def test_sampling_distribution_is_preserved(tiny_models, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """6,000 unseeded requests at temperature 1 / top-p 0.9, 3 output tokens each, with and
    without speculation: the outputs' frequencies agree (chi-square, 9 df, alpha 0.001; the
    engine seeds are fixed, so the test is deterministic). Proposers: n-gram, suffix, a draft
    model (the target with noise on its weights), a fixed draft of the likeliest continuation,
    and a fixed draft of unlikely tokens - each fixed draft also made on the device and
    verified there (ngram_gpu's path, async steps)."""
    from pagedllm.worker.device_drafts import DeviceDrafts
    from tests.models.tiny import make_perturbed_copy

    path = _peaky_model(tiny_models("llama"), str(tmp_path / "peaky"))
    prompt = [{"prompt_token_ids": [7, 21, 99, 7, 21, 99, 7, 21]}]
    n = 6_000  # (10,000 before the suite neared CI's 15 minutes: 8 engines x n requests)
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=3, ignore_eos=True)

    def sample(llm: LLM) -> list[tuple]:
        outs = llm.generate(prompt * n, sp, use_tqdm=False)
        return [tuple(o.outputs[0].token_ids) for o in outs]

    kw = {"max_num_seqs": 1024, "enable_prefix_caching": True}
    ref = sample(_engine(path, seed=1, **kw))
    greedy = _engine(path).generate(
        prompt, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False
    )
    likely = list(greedy[0].outputs[0].token_ids[1:])  # the likeliest second token first
    draft = make_perturbed_copy(path, str(tmp_path / "draft"), DRAFT_NOISE)
    counts = {}
    for name, spec, fixed in (
        ("ngram", NGRAM, None),
        ("suffix", SUFFIX, None),
        ("draft", {"method": "draft_model", "model": draft, "num_speculative_tokens": 2}, None),
        ("likely", NGRAM, likely),
        ("bad", NGRAM, [3, 4, 5]),
        # drafts made on the device and verified there, async steps (the lookup replaced by
        # the same fixed drafts: this prompt's outputs rarely repeat it)
        ("gpu_likely", NGRAM_GPU, likely),
        ("gpu_bad", NGRAM_GPU, [3, 4, 5]),
    ):
        more = {"async_scheduling": True} if spec is NGRAM_GPU else {}
        llm = _engine(path, seed=2, speculative_config=spec, **kw, **more)
        if fixed is not None and spec is NGRAM_GPU:
            monkeypatch.setattr(DeviceDrafts, "verify", _fixed_device_drafts(fixed))
        elif fixed is not None:
            llm.llm_engine.engine_core.scheduler.spec.proposer = _FixedProposer(fixed)
        got = sample(llm)
        m = _spec_stats(llm)
        counts[name] = (m["vllm:spec_decode_num_draft_tokens"].value,
                        m["vllm:spec_decode_num_accepted_tokens"].value)  # fmt: skip
        stat = _chi_square_two_sample(ref, got)
        assert stat < CHI2_9_999, (name, stat)
    # the fixed drafts ran in every request (with 3 tokens to make, one draft at the second
    # token), the likely ones were often accepted, the bad ones almost never
    assert counts["likely"][0] >= n and counts["likely"][1] > 0.1 * n
    assert counts["bad"][0] >= n and counts["bad"][1] < 0.01 * n
    assert counts["draft"][0] >= n and counts["draft"][1] > 0.1 * n  # drafts after token 1
    assert counts["gpu_likely"][0] >= n and counts["gpu_likely"][1] > 0.1 * n
    assert counts["gpu_bad"][0] >= n and counts["gpu_bad"][1] < 0.01 * n
    # and the test can tell: the same statistic between two different prompts' outputs
    other = [{"prompt_token_ids": [8, 21, 99, 8, 21, 99, 8, 22]}]
    other_outs = _engine(path, seed=3, **kw).generate(other * 2000, sp, use_tqdm=False)
    shifted = [tuple(o.outputs[0].token_ids) for o in other_outs]
    assert _chi_square_two_sample(ref[:2000], shifted) > CHI2_9_999


# ------------------------------------------------------------------------ draft model


def test_target_as_its_own_draft_has_every_draft_accepted(tiny_models) -> None:
    """With the target model as its draft (same weights, fp32), every greedy draft is the
    target's own next token: all accepted. A wrong KV of the draft model (a position off, a
    slot missed after a partial acceptance or a prefill chunk) would show as a rejection.
    Chunked prefill and prefix hits included."""
    path = tiny_models("llama")
    prompts = _prompts(6, seed=5)
    prompts += [{"prompt_token_ids": prompts[0]["prompt_token_ids"] + [9, 8, 7]}]
    sp = SamplingParams(temperature=0, max_tokens=33, ignore_eos=True)
    want = _tokens(_engine(path), prompts, sp)
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 4}
    llm = _engine(path, speculative_config=spec, max_num_batched_tokens=16)
    assert _tokens(llm, prompts, sp) == want
    m = _spec_stats(llm)
    drafted = m["vllm:spec_decode_num_draft_tokens"].value
    assert drafted > 100 and m["vllm:spec_decode_num_accepted_tokens"].value == drafted


def test_draft_model_catches_up_after_a_pause(tiny_models) -> None:
    """Under load (``disable_by_batch_size`` 2) the draft model skips its runs; when the long
    request is left alone it first computes its draft KVs for the skipped positions (chunked:
    a budget of 16 tokens a step), then drafts. With the target as its own draft every draft
    is accepted: a skipped position left unfilled or filled at the wrong place would show as
    a rejection. Tokens are those without speculation."""
    path = tiny_models("llama")
    prompts = _prompts(4, seed=3)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (60, 24, 8, 8)]
    want = _tokens(_engine(path), prompts, params)
    mirrored = {}
    for limit in (2, 100):
        spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 3,
                "disable_by_batch_size": limit}  # fmt: skip
        llm = _engine(path, speculative_config=spec, max_num_batched_tokens=16)
        calls = []
        drafter = llm.llm_engine.engine_core.model_runner.drafter
        orig = drafter.mirror
        drafter.mirror = lambda i: (calls.append(i.metadata.num_actual_tokens), orig(i))  # noqa: B023
        assert _tokens(llm, prompts, params) == want, limit
        m = _spec_stats(llm)
        drafted = m["vllm:spec_decode_num_draft_tokens"].value
        assert drafted > 20 and m["vllm:spec_decode_num_accepted_tokens"].value == drafted
        mirrored[limit] = sum(calls)
    # paused steps skip the draft model: the short requests' tokens were never mirrored
    assert 0 < mirrored[2] < mirrored[100] - 40


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_disable_when_slower_keeps_the_tokens(tiny_models, method: str) -> None:
    """``disable_when_slower``: speculation switches on and off by measured step times and
    acceptance (phases of 8 steps, both modes timed at each load, shadow drafts while paused
    for n-gram) with asynchronous steps while off. Tokens are those without speculation, and
    with the target as its own draft every draft is still accepted (the draft model catches up
    on the positions of the steps it skipped)."""
    path = tiny_models("llama")
    prompts = _prompts(4, seed=5)
    lens = (120, 40, 24, 8)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
    want = _tokens(_engine(path), prompts, params)
    if method == "ngram":
        spec = {**NGRAM, "disable_when_slower": True}
    else:
        spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 3,
                "disable_when_slower": True}  # fmt: skip
    llm = _engine(path, speculative_config=spec, async_scheduling=True)
    assert _tokens(llm, prompts, params) == want
    pacer = llm.llm_engine.engine_core.scheduler.spec.pacer
    assert any(len(b.step_s) == 2 for b in pacer.buckets.values())  # both modes ran somewhere
    assert pacer.samples > 0  # the acceptance was measured
    m = _spec_stats(llm)
    drafted = m["vllm:spec_decode_num_draft_tokens"].value
    assert drafted > 0
    if method == "draft_model":
        assert m["vllm:spec_decode_num_accepted_tokens"].value == drafted


@pytest.mark.parametrize(
    ("target", "draft"), [("llama", "qwen3"), ("gemma3", "llama"), ("qwen3", "gemma3")]
)
def test_draft_of_another_architecture(tiny_models, target: str, draft: str) -> None:
    """A draft model of another architecture and other KV shapes (head size 16 vs 32; Gemma
    3's sliding windows): its layers get cache tensors of their own in the same blocks; the
    tokens are the target's."""
    path = tiny_models(target)
    prompts = _prompts(5, seed=6)
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = _tokens(_engine(path), prompts, sp)
    spec = {"method": "draft_model", "model": tiny_models(draft), "num_speculative_tokens": 3}
    llm = _engine(path, speculative_config=spec)
    assert _tokens(llm, prompts, sp) == want
    assert _spec_stats(llm)["vllm:spec_decode_num_draft_tokens"].value > 0
    llm.llm_engine.engine_core.check_integrity()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_draft_model_through_preemption(tiny_models, draft_of, mode: str) -> None:  # noqa: ANN001
    """A cache too small for the batch: requests are preempted (their draft KVs go and come
    back with the target's) and resume with the same tokens."""
    path = tiny_models("llama")
    prompts = _prompts(6, seed=7)
    sp = SamplingParams(temperature=0, max_tokens=28, ignore_eos=True)
    kw = dict(block_size=8, num_gpu_blocks_override=16, preemption_mode=mode,
              enable_prefix_caching=False)  # fmt: skip
    if mode == "swap":
        kw["swap_space"] = 0.01
    want = _tokens(_engine(path, **kw), prompts, sp)
    # and ngram_gpu with async steps: a request preempted while its drafts are unverified
    # (swapped: they are taken back when its step resolves; recomputed: forgotten)
    for spec, more in ((draft_of("llama"), {}), (NGRAM_GPU, {"async_scheduling": True})):
        llm = _engine(path, speculative_config=spec, **kw, **more)
        assert _tokens(llm, prompts, sp) == want, spec["method"]
        core = llm.llm_engine.engine_core
        assert core.scheduler.num_preemptions > 0, "the case meant to preempt did not"
        if mode == "swap":
            assert core.scheduler.num_swaps > 0
        assert _spec_stats(llm)["vllm:spec_decode_num_accepted_tokens"].value > 0
        core.check_integrity()


def test_draft_model_must_fit_the_target(tiny_models, tmp_path) -> None:
    """A draft with another vocabulary, another tokenizer or a shorter context is refused at
    start with the field named; speculation with a draft model and KV-Compress too."""
    import json
    import shutil

    from tests.models.tiny import make_tiny_model

    path = tiny_models("llama")
    big = make_tiny_model("llama", str(tmp_path / "big"))
    with open(tmp_path / "big" / "config.json") as f:
        cfg = json.load(f)
    cfg["vocab_size"] = 600
    with open(tmp_path / "big" / "config.json", "w") as f:
        json.dump(cfg, f)
    other_tok = shutil.copytree(path, tmp_path / "tok")
    with open(other_tok / "tokenizer.json") as f:
        tok = json.load(f)
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[10:12]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two tokens swapped: another tokenizer
    with open(other_tok / "tokenizer.json", "w") as f:
        json.dump(tok, f)
    cases = [
        (big, "vocabulary of 600"),
        (str(other_tok), "another tokenizer"),
        (str(tmp_path / "missing"), "cannot be loaded"),
    ]
    for draft, why in cases:
        spec = {"model": draft, "num_speculative_tokens": 2}
        with pytest.raises(ValueError, match="speculative_config.model") as e:
            LLM(path, dtype="float32", device="cpu", speculative_config=spec)
        assert why in str(e.value)
    short = shutil.copytree(path, tmp_path / "short")
    cfg = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 128}))
    spec = {"model": str(short), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="max_position_embeddings 128, below the target's"):
        LLM(path, dtype="float32", device="cpu", max_model_len=256, speculative_config=spec)
    spec = {"model": path, "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="enable_kvc"):
        LLM(path, dtype="float32", device="cpu", enable_kvc=True, speculative_config=spec)
