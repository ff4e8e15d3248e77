"""The offline API and the engine loop: sampling parameters, stops, logprobs, bad input."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.core.request import RequestStatus
from pagedllm.engine.llm_engine import LLMEngine


@pytest.fixture(scope="module")
def llm(tiny_models) -> LLM:
    return LLM(tiny_models("llama"), dtype="float32", max_model_len=256, seed=0)


def _ids(n: int, seed: int = 0) -> dict:
    return {"prompt_token_ids": np.random.default_rng(seed).integers(3, 250, size=n).tolist()}


def test_outputs_in_input_order_with_fields(llm):
    prompts = ["Hello, my name is", "The capital of France is", "a"]
    outs = llm.generate(
        prompts, SamplingParams(temperature=0.8, top_p=0.95, max_tokens=8), use_tqdm=False
    )
    assert [o.prompt for o in outs] == prompts
    tok = llm.get_tokenizer()
    for o in outs:
        assert o.finished and o.prompt_token_ids == tok.encode(o.prompt)
        c = o.outputs[0]
        assert c.index == 0 and 1 <= len(c.token_ids) <= 8
        assert c.finish_reason in ("stop", "length")
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True) or c.finish_reason


def test_seed_reproducible_regardless_of_batch(llm):
    p = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([_ids(10)], p, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    mixed = llm.generate([_ids(30, 1), _ids(10), _ids(5, 2)], [others, p, others], use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone
    other_seed = llm.generate(
        [_ids(10)],
        SamplingParams(temperature=1.0, seed=99, max_tokens=16, ignore_eos=True),
        use_tqdm=False,
    )
    assert other_seed[0].outputs[0].token_ids != alone


def test_seed_survives_preemption(tiny_models):
    path = tiny_models("llama")
    p = SamplingParams(temperature=1.0, seed=7, max_tokens=20, ignore_eos=True)
    prompts = [_ids(40, i) for i in range(6)]
    roomy = LLM(path, dtype="float32", max_model_len=256).generate(prompts, p, use_tqdm=False)
    tight_llm = LLM(
        path, dtype="float32", max_model_len=256, block_size=8, num_gpu_blocks_override=10
    )
    tight = tight_llm.generate(prompts, p, use_tqdm=False)
    assert tight_llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in tight] == [o.outputs[0].token_ids for o in roomy]


def test_top_k_1_is_greedy_and_top_p_tiny_is_greedy(llm):
    greedy = llm.generate(
        [_ids(12)], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False
    )
    for p in (
        SamplingParams(temperature=1.5, top_k=1, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=1.5, top_p=1e-6, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=1.5, min_p=1.0, max_tokens=10, ignore_eos=True),
    ):
        out = llm.generate([_ids(12)], p, use_tqdm=False)
        assert out[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids


def test_sampling_follows_the_distribution(llm):
    # 200 seeded first tokens at temperature 1 agree with the model's softmax (chi-square-ish
    # check on the top tokens): a sampler that ignored the distribution would fail.
    prompt = _ids(6)
    outs = llm.generate(
        [prompt] * 200,
        [SamplingParams(temperature=1.0, seed=s, max_tokens=1, logprobs=0) for s in range(200)],
        use_tqdm=False,
    )
    firsts = [o.outputs[0].token_ids[0] for o in outs]
    lp = {
        o.outputs[0].token_ids[0]: o.outputs[0].logprobs[0][o.outputs[0].token_ids[0]].logprob
        for o in outs
    }
    top = max(lp, key=lp.get)
    expected = np.exp(lp[top]) * 200
    assert abs(firsts.count(top) - expected) < 4 * np.sqrt(expected) + 3


def test_stop_strings_and_include(llm):
    base = llm.generate(
        [_ids(8)], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    text = base.text
    assert len(text) > 6
    stop = text[3:6]
    out = llm.generate(
        [_ids(8)],
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    out = llm.generate(
        [_ids(8)],
        SamplingParams(
            temperature=0,
            max_tokens=20,
            ignore_eos=True,
            stop=[stop],
            include_stop_str_in_output=True,
        ),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.text == text[: text.index(stop) + len(stop)]


def test_stop_token_ids_min_tokens_and_eos(llm):
    base = (
        llm.generate(
            [_ids(8)], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False
        )[0]
        .outputs[0]
        .token_ids
    )
    target = base[4]
    first = base.index(target)
    out = llm.generate(
        [_ids(8)],
        SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[target]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids == base[: first + 1] and out.stop_reason == target
    assert out.finish_reason == "stop"
    # min_tokens forbids stop tokens until reached: the target cannot appear before index 6
    out = llm.generate(
        [_ids(8)],
        SamplingParams(temperature=0, max_tokens=10, min_tokens=6, stop_token_ids=[target]),
        use_tqdm=False,
    )[0].outputs[0]
    assert target not in out.token_ids[:6]


def test_logprobs_and_prompt_logprobs(llm, tiny_models):
    import transformers as tf

    prompt = _ids(20)
    out = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=4, logprobs=3, prompt_logprobs=2, ignore_eos=True),
        use_tqdm=False,
    )[0]
    c = out.outputs[0]
    assert len(c.logprobs) == 4
    assert all(3 <= len(d) <= 4 and tok in d for d, tok in zip(c.logprobs, c.token_ids))
    assert c.cumulative_logprob == pytest.approx(
        sum(d[t].logprob for d, t in zip(c.logprobs, c.token_ids))
    )
    model = tf.AutoModelForCausalLM.from_pretrained(tiny_models("llama"), dtype=torch.float32)
    ids = prompt["prompt_token_ids"]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].log_softmax(-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for i in range(1, len(ids)):
        d = out.prompt_logprobs[i]
        assert abs(d[ids[i]].logprob - float(ref[i - 1, ids[i]])) < 1e-3
        assert len(d) >= 2


def test_prompt_logprobs_with_chunked_prefill(tiny_models):
    small = LLM(tiny_models("llama"), dtype="float32", max_model_len=256, max_num_batched_tokens=16)
    big = LLM(tiny_models("llama"), dtype="float32", max_model_len=256)
    p = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    a = small.generate([_ids(50)], p, use_tqdm=False)[0].prompt_logprobs
    b = big.generate([_ids(50)], p, use_tqdm=False)[0].prompt_logprobs
    assert len(a) == len(b) == 50
    for x, y in zip(a[1:], b[1:]):
        assert x.keys() == y.keys()
        assert all(abs(x[k].logprob - y[k].logprob) < 1e-4 for k in x)
    # the runner counts its rows that ask for prompt logprobs (a step skips the search at 0;
    # finished requests leave their rows at the next step): the count matches the rows
    ib = small.llm_engine.engine_core.model_runner.input_batch

    def asking() -> int:
        return sum(q is not None and q.prompt_logprobs is not None for q in ib.sampling_params)

    assert ib.num_prompt_logprobs == asking()
    outs = small.generate([_ids(30), _ids(40)], [SamplingParams(max_tokens=2), p], use_tqdm=False)
    assert outs[0].prompt_logprobs is None and len(outs[1].prompt_logprobs) == 40
    assert ib.num_prompt_logprobs == asking()
    small.generate([_ids(9)], SamplingParams(max_tokens=3), use_tqdm=False)  # frees the rows
    assert ib.num_prompt_logprobs == asking() == 0


def test_chat_uses_template(llm):
    outs = llm.chat(
        [{"role": "user", "content": "hi"}],
        SamplingParams(temperature=0, max_tokens=4),
        use_tqdm=False,
    )
    assert outs[0].prompt.startswith("<s>user: hi")


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"n": 0}, "n"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_raise_and_run_nothing(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([{"prompt_token_ids": [5] * 300}], use_tqdm=False)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([{"prompt_token_ids": [5, 10**6]}], use_tqdm=False)
    # a bad prompt among good ones: nothing was queued
    with pytest.raises(ValueError):
        llm.generate(["fine", ""], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"dtype": "int8"}, "dtype"),
        ({"block_size": 3}, "block_size"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"device": "tpu"}, "device"),
        ({"max_model_len": 10**7}, "max_model_len"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"no_such_arg": 1}, "no_such_arg"),
    ],
)
def test_bad_engine_args(tiny_models, kwargs, field):
    with pytest.raises(ValueError, match=field):
        LLM(tiny_models("llama"), **kwargs)


def test_unknown_model_path():
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        LLM("/nonexistent/does-not-exist")


def test_engine_bad_request_does_not_hurt_others(tiny_models):
    engine = LLMEngine.from_engine_args(
        __import__("pagedllm").EngineArgs(
            model=tiny_models("llama"), dtype="float32", max_model_len=128
        )
    )
    p = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    engine.add_request("good1", _ids(10), p)
    for bad in ("", {"prompt_token_ids": [1] * 500}, {"prompt_token_ids": []}):
        with pytest.raises(ValueError):
            engine.add_request("bad", bad, p)
    engine.add_request("good2", _ids(12), p)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("good2", _ids(12), p)
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    assert set(done) == {"good1", "good2"}
    assert all(len(o.outputs[0].token_ids) == 5 for o in done.values())
    engine.engine_core.check_integrity()


def test_abort_frees_blocks_and_stops_work(tiny_models):
    from pagedllm.config import EngineArgs

    engine = LLMEngine.from_engine_args(
        EngineArgs(model=tiny_models("llama"), dtype="float32", max_model_len=128)
    )
    p = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"r{i}", _ids(20, i), p, output_kind="delta")
    engine.step()
    engine.step()
    finals = engine.abort_request(["r1", "r3"])
    assert {o.request_id for o in finals} == {"r1", "r3"}
    assert all(o.outputs[0].finish_reason == "abort" for o in finals)
    seen = set()
    while engine.has_unfinished_requests():
        seen |= {o.request_id for o in engine.step()}
    assert seen == {"r0", "r2"}  # no work for aborted requests
    sched = engine.engine_core.scheduler
    assert sched.kv_cache_manager.num_free_blocks() == sched.kv_cache_manager.num_blocks
    engine.engine_core.check_integrity()
    assert RequestStatus.FINISHED_ABORTED.is_finished()


@pytest.mark.parametrize("policy", ["fcfs", "priority", "sjf"])
def test_dropping_an_llm_frees_the_engine_without_the_cyclic_collector(tiny_models, policy):
    """A CUDA engine freezes the cyclic collector's view after start-up (gc.freeze): whatever
    an engine keeps in a reference cycle would then never be freed. Dropping the LLM must free
    the engine, its scheduler, KV cache manager and model runner by reference counting alone."""
    import gc
    import weakref

    llm = LLM(tiny_models("llama"), dtype="float32", max_model_len=128, scheduling_policy=policy)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=3), use_tqdm=False)
    if policy == "fcfs" and importlib.util.find_spec("xgrammar") is not None:
        from pagedllm.structured_output.params import StructuredOutputsParams

        so = StructuredOutputsParams(choice=["yes", "no"])
        llm.generate(["Hi"], SamplingParams(max_tokens=4, structured_outputs=so), use_tqdm=False)
    core = llm.llm_engine.engine_core
    parts = [
        llm.llm_engine,
        core,
        core.scheduler,
        core.scheduler.kv_cache_manager,
        core.model_runner,
        core.model_runner.model,
    ]
    refs = [weakref.ref(p) for p in parts]
    del parts, core
    gc.collect()
    gc.disable()
    try:
        del llm
        alive = [type(r()).__name__ for r in refs if r() is not None]
    finally:
        gc.enable()
    assert alive == []


def test_argmax_only_steps_keep_model_dtype_logits_and_the_same_tokens(tiny_models):
    """A step whose rows are all plain greedy takes the argmax of the bf16 logits (no float32
    copy of the batch's logits); asking for logprobs or a penalty forces float32, and both ways
    give the same greedy tokens."""
    llm = LLM(tiny_models("qwen3"), dtype="bfloat16", max_model_len=256)
    model = llm.llm_engine.engine_core.model_runner.model
    seen: list[bool] = []
    orig = model.compute_logits

    def spy(hidden, float32=True):  # noqa: ANN001, ANN202
        seen.append(float32)
        return orig(hidden, float32=float32)

    model.compute_logits = spy
    prompts = [_ids(12, s) for s in range(4)]

    def run(**kw) -> list[list[int]]:  # noqa: ANN003
        p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **kw)
        seen.clear()
        outs = llm.generate(prompts, p, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    plain = run()
    assert seen and not any(seen)
    for kw in ({"logprobs": 0}, {"repetition_penalty": 1.0 + 1e-9}):
        assert run(**kw) == plain, kw
        assert all(seen), kw


def test_vllm_import_paths() -> None:
    """What vLLM users import from ``vllm.sampling_params`` comes from ours too."""
    from pagedllm.beam_search import BeamSearchParams as B
    from pagedllm.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams
    from pagedllm.structured_output.params import StructuredOutputsParams as S

    assert BeamSearchParams is B and StructuredOutputsParams is S
    sp = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a", "b"]))
    assert isinstance(sp.structured_outputs, S)
