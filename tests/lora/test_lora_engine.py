"""LoRA adapters in the engine (CPU): one batch mixing two adapters and the base model gives
each adapter's greedy tokens as its merged checkpoint run alone does, and as HF transformers
+ PEFT does; adapters never share prefix-cache blocks; adapters are added and removed at run
time; max_loras 1 serves two adapters in turn; bad adapters are refused with a ValueError."""

from __future__ import annotations

import pytest

from pagedllm.lora import LoRARequest
from tests.lora.adapters import PARAMS
from tests.lora.adapters import engine as _engine
from tests.lora.adapters import prompts as _prompts
from tests.lora.adapters import tokens as _tokens


def test_one_batch_mixes_two_adapters_and_the_base_model(lora_setup, references):
    base, adapters, _ = lora_setup
    reqs = {n: LoRARequest(n, i, p) for i, (n, p) in enumerate(adapters.items(), start=1)}
    llm = _engine(base, enable_lora=True, max_loras=2)
    prompts = _prompts()
    names = ["a1", "a2", "base"] * len(prompts)  # every prompt under each, interleaved
    batch = [p for p in prompts for _ in range(3)]
    outs = llm.generate(
        batch, PARAMS, use_tqdm=False, lora_request=[reqs.get(n) for n in names]
    )
    got = _tokens(outs)
    for j, name in enumerate(names):
        assert got[j] == references[name][j // 3], (j, name)
    llm.llm_engine.engine_core.check_integrity()


def test_beam_search_with_an_adapter_equals_its_merged_checkpoint(lora_setup):
    """Every beam of a search runs with the search's adapter: the hypotheses equal those of
    the merged checkpoint searched alone, and differ from the base model's."""
    from pagedllm.beam_search import BeamSearchParams

    base, adapters, merged = lora_setup
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in _prompts(2)]

    def hyps(outs) -> list[list[list[int]]]:  # noqa: ANN001
        return [[s.tokens for s in o.sequences] for o in outs]

    lora = LoRARequest("a2", 2, adapters["a2"])
    llm = _engine(base, enable_lora=True, max_loras=2)
    got = hyps(llm.beam_search(prompts, params, lora_request=lora))
    plain = hyps(llm.beam_search(prompts, params))
    want = hyps(_engine(merged["a2"]).beam_search(prompts, params))
    assert got == want and got != plain


def test_prefix_cache_is_per_adapter(lora_setup, references):
    """The same prompt under a1, then a2, then a1 again: a2 finds none of a1's blocks, the
    second a1 finds them; every output stays its merged reference."""
    base, adapters, _ = lora_setup
    a1, a2 = LoRARequest("a1", 1, adapters["a1"]), LoRARequest("a2", 2, adapters["a2"])
    llm = _engine(base, enable_lora=True, max_loras=2, enable_prefix_caching=True)
    prompt = _prompts()[2]  # 40 tokens: 4 full blocks of 8 to share
    cached = []
    for lr, name in ((a1, "a1"), (a2, "a2"), (a1, "a1"), (None, "base")):
        out = llm.generate([prompt], PARAMS, use_tqdm=False, lora_request=lr)[0]
        assert out.outputs[0].token_ids == references[name][2], name
        cached.append(out.num_cached_tokens)
    assert cached == [0, 0, 32, 0], cached
    llm.llm_engine.engine_core.check_integrity()


def test_adapters_added_and_removed_at_run_time(lora_setup, references):
    base, adapters, _ = lora_setup
    llm = _engine(base, enable_lora=True, max_cpu_loras=2, lora_modules=[f"a1={adapters['a1']}"])
    assert [(r.lora_name, r.lora_int_id) for r in llm.list_loras()] == [("a1", 1)]
    a2 = LoRARequest("a2", 7, adapters["a2"])
    assert llm.add_lora(a2) is True
    assert llm.add_lora(a2) is False  # already loaded
    assert [r.lora_name for r in llm.list_loras()] == ["a1", "a2"]
    with pytest.raises(ValueError, match="taken"):
        llm.add_lora(LoRARequest("a2", 8, adapters["a1"]))
    prompts = _prompts()
    a1 = llm.list_loras()[0]
    outs = llm.generate(prompts, PARAMS, use_tqdm=False, lora_request=a2)
    assert _tokens(outs) == references["a2"]
    assert llm.remove_lora("a1") is True
    assert llm.remove_lora(1) is False  # already gone
    assert [r.lora_name for r in llm.list_loras()] == ["a2"]
    assert llm.remove_lora(7) is True and llm.list_loras() == []
    # a request naming a removed adapter loads it again
    outs = llm.generate(prompts, PARAMS, use_tqdm=False, lora_request=a1)
    assert _tokens(outs) == references["a1"]


def test_max_loras_1_serves_two_adapters_in_turn(lora_setup, references):
    """Two adapters in flight with one device slot: both complete with their own tokens,
    and no step ever runs both (the scheduler holds the second back)."""
    base, adapters, _ = lora_setup
    reqs = [LoRARequest("a1", 1, adapters["a1"]), LoRARequest("a2", 2, adapters["a2"])]
    llm = _engine(base, enable_lora=True, max_loras=1, max_cpu_loras=2)
    worker = llm.llm_engine.engine_core.model_runner.lora
    seen: list[set[int]] = []
    prepare = worker.prepare

    def spy(lora_ids, n_sched):  # noqa: ANN001, ANN202
        seen.append({int(i) for i in lora_ids} - {0})
        prepare(lora_ids, n_sched)

    worker.prepare = spy
    prompts = _prompts()
    loras = [reqs[0]] * 3 + [reqs[1]] * 3
    outs = llm.generate(prompts * 2, PARAMS, use_tqdm=False, lora_request=loras)
    got = _tokens(outs)
    assert got[:3] == references["a1"] and got[3:] == references["a2"]
    assert max(len(s) for s in seen) == 1 and {1, 2} <= set().union(*seen)


def test_bad_adapters_are_refused(lora_setup, tmp_path):
    from tests.lora.adapters import edit_config, make_adapter

    base, adapters, _ = lora_setup
    llm = _engine(base, enable_lora=True, max_lora_rank=8)
    bad = {
        "rank": (adapters["a2"], "above max_lora_rank"),
        "dora": (edit_config(adapters["a1"], str(tmp_path / "dora"), use_dora=True), "DoRA"),
        "save": (edit_config(adapters["a1"], str(tmp_path / "save"),
                             modules_to_save=["lm_head"]), "modules_to_save"),
        "missing": (str(tmp_path / "nowhere"), "not found"),
        "embed": (make_adapter(base, str(tmp_path / "embed"), 3, ["embed_tokens"]),
                  "not supported"),
    }  # fmt: skip
    # an adapter of another model: a wider MLP
    from tests.models.tiny import make_tiny_model

    other = make_tiny_model("llama", str(tmp_path / "wide"), intermediate_size=96)
    bad["shape"] = (make_adapter(other, str(tmp_path / "wide-a"), 4, ["down_proj"]), "needs")
    for i, (name, (path, why)) in enumerate(bad.items(), start=10):
        with pytest.raises(ValueError, match=why) as e:
            llm.add_lora(LoRARequest(name, i, path))
        assert repr(name) in str(e.value)
        with pytest.raises(ValueError, match=why):  # through a request: nothing queued
            lr = LoRARequest(name, i, path)
            llm.generate([[5, 6, 7]], PARAMS, use_tqdm=False, lora_request=lr)
    assert llm.list_loras() == [] and not llm.llm_engine.has_unfinished_requests()
    ok = LoRARequest("a1", 1, adapters["a1"])
    assert llm.generate([[5, 6, 7]], PARAMS, use_tqdm=False, lora_request=ok)[0].finished


def test_lora_arguments_are_checked(lora_setup):
    base, adapters, _ = lora_setup
    cases = {
        "lora_modules needs enable_lora": dict(lora_modules=[f"a1={adapters['a1']}"]),
        "max_cpu_loras": dict(enable_lora=True, max_loras=2, max_cpu_loras=1),
        "max_lora_rank": dict(enable_lora=True, max_lora_rank=0),
        "lora_modules entry": dict(enable_lora=True, lora_modules=["no-path"]),
        "speculative_config": dict(enable_lora=True, speculative_config={"method": "ngram"}),
        "enable_kvc": dict(enable_lora=True, enable_kvc=True),
    }
    for why, kw in cases.items():
        with pytest.raises(ValueError, match=why):
            _engine(base, **kw)
    llm = _engine(base)
    with pytest.raises(ValueError, match="enable_lora"):
        llm.generate([[5, 6]], PARAMS, lora_request=LoRARequest("a1", 1, adapters["a1"]))


def test_tensor_parallel_2_shards_the_adapters(lora_setup, references):
    """Two CPU ranks (gloo): column-parallel layers keep their rows of B, row-parallel ones
    their columns of A with the shrink summed over the ranks; the mixed batch's tokens are
    the references'."""
    base, adapters, _ = lora_setup
    reqs = {n: LoRARequest(n, i, p) for i, (n, p) in enumerate(adapters.items(), start=1)}
    llm = _engine(base, enable_lora=True, max_loras=2, tensor_parallel_size=2)
    try:
        names = ["a1", "a2", "base"]
        batch = [p for p in _prompts() for _ in names]
        loras = [reqs.get(n) for _ in _prompts() for n in names]
        got = _tokens(llm.generate(batch, PARAMS, use_tqdm=False, lora_request=loras))
        for j, name in enumerate(names * 3):
            assert got[j] == references[name][j // 3], (j, name)
    finally:
        llm.llm_engine.engine_core.shutdown()
