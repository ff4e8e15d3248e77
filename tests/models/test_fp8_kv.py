"""fp8 KV caches end to end (``kv_cache_dtype="fp8"``, issue 56), on the CPU backend (or
the Triton one on a GPU): half the bytes a token of bfloat16 (a quarter of float32), so
twice the blocks in the same memory; the next tokens' distributions stay close to the
full-precision cache's on every architecture; the quantized cache behaves as one cache
whatever the path to it (prefix hits, chunked prefill, swap, the host tier: the same tokens
and logprobs); the scales come from the checkpoint, 1.0, or the first step
(``calculate_kv_scales``); bad settings are refused with the field named."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
ARCHS = ["llama", "qwen2", "qwen3", "mistral", "gemma3"]


def _prompts(n: int = 4, seed: int = 0, shared: int = 40) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, 500, size=shared).tolist()
    return [prefix + rng.integers(3, 500, size=int(k)).tolist() for k in (9, 23, 31, 5)[:n]]


def _llm(path: str, **kw: Any) -> LLM:
    kw = {"max_model_len": 256, "dtype": "float32", "seed": 0, **kw}  # a GPU where there is one
    return LLM(path, **kw)


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.llm_engine.engine_core.check_integrity()
    return [
        (
            list(o.outputs[0].token_ids),
            [d[t].logprob for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)],
        )
        for o in outs
    ]


def _runner(llm: LLM) -> Any:
    return llm.llm_engine.engine_core.executor.runner


@torch.inference_mode()
def _profiling_pass(llm: LLM) -> None:
    """The forward pass over dummy tokens that sizes a GPU's KV cache (``_dummy_run``),
    run here on the CPU engine's cache; the scales must still wait for real tokens."""
    runner = _runner(llm)
    runner._dummy_run(64, 8)
    scales = runner.kv_layout.kv_scales
    assert scales.calibrate_pending and all(bool((s == 1).all()) for s in scales.scales)


def test_start_up_kernel_passes_leave_the_cache_as_it_was(tiny_models, monkeypatch):
    """The passes a GPU runner makes at start-up to compile each prefill tile shape of the
    attention kernel (``KVCacheLayout.capture_graphs``), run here on the CPU engine with the
    lengths a GPU would pick: the scales still wait for real tokens, and the engine then
    gives the tokens and logprobs of one that made no such pass."""
    path = tiny_models("llama")
    kw = dict(kv_cache_dtype="fp8", calculate_kv_scales=True, max_num_batched_tokens=32)
    cold = _run(_llm(path, **kw), _prompts())
    llm = _llm(path, **kw)
    runner = _runner(llm)
    import pagedllm.ops.paged_attention as pa

    lens = pa.prefill_variant_query_lens(128, 2, torch.device("cpu"), 1, 4096)
    assert lens == [2, 9, 17]  # tiles of 16, 32 and 64 query rows x heads
    monkeypatch.setattr(type(runner.backend), "prefill_variant_query_lens",
                        lambda self, *a: lens, raising=False)  # fmt: skip
    calls = []
    dummy = runner._dummy_run
    monkeypatch.setattr(runner, "_dummy_run", lambda q, n: (calls.append(q), dummy(q, n)))
    assert runner.kv_layout.capture_graphs(runner) is False
    assert calls == lens
    scales = runner.kv_layout.kv_scales
    assert scales.calibrate_pending and all(bool((s == 1).all()) for s in scales.scales)
    warm = _run(llm, _prompts())
    for (t1, lp1), (t2, lp2) in zip(cold, warm):
        assert t1 == t2
        np.testing.assert_allclose(lp1, lp2, atol=1e-5)


def _teacher_forced(llm: LLM, prompts: list[list[int]], targets: list[list[int]]) -> np.ndarray:
    """The log-probabilities of ``targets`` after each prompt, token by token (prompt
    logprobs of prompt + target)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate(
        [{"prompt_token_ids": p + t} for p, t in zip(prompts, targets)], params, use_tqdm=False
    )
    lps = []
    for o, p, t in zip(outs, prompts, targets):
        plp = o.prompt_logprobs
        lps += [plp[len(p) + i][tok].logprob for i, tok in enumerate(t)]
    return np.array(lps)


def test_fp8_doubles_the_blocks_of_a_budget(tiny_models):
    """The same KV memory holds 4x the float32 blocks and 2x the bfloat16 ones."""
    path = tiny_models("llama")
    mem = 2**20
    blocks = {}
    for dtype, kv in (("float32", "auto"), ("bfloat16", "auto"), ("float32", "fp8")):
        llm = _llm(path, dtype=dtype, kv_cache_dtype=kv, kv_cache_memory_bytes=mem)
        r = _runner(llm)
        blocks[dtype, kv] = r.num_blocks
        assert r.num_blocks * r.kv_bytes_per_block() <= mem
        want = torch.float8_e4m3fn if kv == "fp8" else getattr(torch, dtype)
        assert r.kv_caches[0].dtype == want
    assert blocks["float32", "fp8"] == 4 * blocks["float32", "auto"]
    assert blocks["float32", "fp8"] == 2 * blocks["bfloat16", "auto"]
    # the scheduler's pool is the runner's
    kv = llm.llm_engine.engine_core.scheduler.kv_cache_manager
    assert kv.num_blocks == blocks["float32", "fp8"]


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_stays_close_to_the_full_precision_cache(arch, tiny_models):
    """Teacher-forced log-probabilities of the full cache's greedy tokens, read through an fp8
    cache, within 0.05 nats on average of the full cache's (and not equal: the cache is fp8)."""
    path = tiny_models(arch)
    prompts = _prompts()
    full = _llm(path)
    targets = [toks for toks, _ in _run(full, prompts)]
    ref = _teacher_forced(full, prompts, targets)
    got = _teacher_forced(_llm(path, kv_cache_dtype="fp8"), prompts, targets)
    diff = np.abs(got - ref)
    assert diff.mean() < 0.05 and diff.max() < 0.3, (diff.mean(), diff.max())
    assert diff.max() > 0


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_every_path_to_the_fp8_cache_gives_the_same_tokens(arch, tiny_models):
    """Prefix-cache hits (one request at a time), no prefix caching, chunked prefill (16-token
    steps): every prompt attends to the same quantized K/V (the CPU backend reads a first
    chunk's keys back from the cache too), so tokens and logprobs agree."""
    path = tiny_models(arch)
    prompts = _prompts()
    kw = {"kv_cache_dtype": "fp8"}
    llm = _llm(path, max_num_seqs=1, **kw)
    hits = _run(llm, prompts)
    assert llm.llm_engine.engine_core.scheduler.kv_cache_manager.prefix_cache_hits > 0
    cold = _run(_llm(path, enable_prefix_caching=False, **kw), prompts)
    chunked = _run(_llm(path, max_num_batched_tokens=16, **kw), prompts)
    for a, b, c in zip(hits, cold, chunked):
        assert a[0] == b[0] == c[0]
        np.testing.assert_allclose(a[1], b[1], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(c[1], b[1], rtol=1e-4, atol=1e-4)


def test_swap_and_the_host_tier_move_fp8_blocks_whole(tiny_models):
    """Swap preemption (12 blocks of 8 for 6 requests) and the host tier (a prefix pushed out and
    loaded back) copy fp8 blocks byte for byte: the same tokens and logprobs as an engine
    that never preempts or evicts."""
    path = tiny_models("llama")
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 500, size=40).tolist() for _ in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
    kw = {"kv_cache_dtype": "fp8"}
    roomy = _run(_llm(path, **kw), prompts, params)
    tight = _llm(
        path, block_size=8, num_gpu_blocks_override=12, preemption_mode="swap", swap_space=0.01,
        enable_prefix_caching=False, **kw,
    )  # fmt: skip
    swapped = _run(tight, prompts, params)
    assert tight.llm_engine.engine_core.scheduler.num_swaps > 0
    for a, b in zip(swapped, roomy):
        assert a[0] == b[0]
        np.testing.assert_allclose(a[1], b[1], rtol=1e-4, atol=1e-4)

    first = rng.integers(3, 500, size=150).tolist()
    others = [rng.integers(3, 500, size=150).tolist() for _ in range(4)]
    tier = _llm(path, num_gpu_blocks_override=24, max_num_seqs=2, kv_offloading_size=0.01, **kw)
    cold = _run(tier, [first])
    _run(tier, others)
    again = _run(tier, [first])
    assert tier.llm_engine.engine_core.stats()["offload_hit_tokens"] == 9 * 16
    assert again[0][0] == cold[0][0]
    np.testing.assert_allclose(again[0][1], cold[0][1], rtol=1e-4, atol=1e-4)


def test_calculate_kv_scales_sets_them_from_the_first_step(tiny_models):
    """Scales start at 1.0; ``calculate_kv_scales`` sets them once, from the first step with
    tokens: that prompt's largest |K| of each head lands at code ~200 (of 448), |V| at ~100;
    later requests keep them."""
    path = tiny_models("qwen3")
    prompts = _prompts()
    fixed = _llm(path, kv_cache_dtype="fp8")
    _run(fixed, prompts[:1])
    assert all(bool((s == 1).all()) for s in _runner(fixed).kv_layout.scales)

    llm = _llm(path, kv_cache_dtype="fp8", calculate_kv_scales=True, enable_prefix_caching=False)
    runner = _runner(llm)
    _run(llm, prompts[:1])
    scales = [s.clone() for s in runner.kv_layout.scales]
    assert all(bool((s != 1).all()) and bool((s > 0).all()) for s in scales)
    k_codes = runner.kv_caches[0][0].float().abs()  # [num_blocks, bs, kvh, d]
    v_codes = runner.kv_caches[0][1].float().abs()
    for h in range(k_codes.shape[2]):
        assert 176 <= float(k_codes[:, :, h].max()) <= 224
        assert 88 <= float(v_codes[:, :, h].max()) <= 112
    _run(llm, prompts[1:])
    assert all(torch.equal(a, b) for a, b in zip(scales, runner.kv_layout.scales))


def _with_scales(src: str, dst: str, k_scale: torch.Tensor, v_scale: torch.Tensor) -> str:
    """A copy of the model folder whose checkpoint also holds every layer's k_scale /
    v_scale (and a q_scale, which is not used), as fp8 checkpoints do."""
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if not name.endswith(".safetensors"):
            with open(os.path.join(src, name), "rb") as f, open(os.path.join(dst, name), "wb") as g:
                g.write(f.read())
    tensors = {}
    for name in os.listdir(src):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(src, name)))
    layers = json.load(open(os.path.join(src, "config.json")))["num_hidden_layers"]
    for i in range(layers):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = k_scale.clone()
        tensors[f"model.layers.{i}.self_attn.v_scale"] = v_scale.clone()
        tensors[f"model.layers.{i}.self_attn.q_scale"] = torch.tensor(1.0)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    return dst


def test_checkpoint_scales_are_loaded(tiny_models, tmp_path):
    """A checkpoint's per-layer (one value) or per-KV-head scales start the fp8 cache; a cache
    of the model's dtype loads the same checkpoint and ignores them; a scale of the wrong size
    is refused with its name."""
    src = tiny_models("llama")
    kvh = json.load(open(os.path.join(src, "config.json")))["num_key_value_heads"]
    one = _with_scales(src, str(tmp_path / "one"), torch.tensor(0.25), torch.tensor(0.125))
    runner = _runner(_llm(one, kv_cache_dtype="fp8"))
    for s in runner.kv_layout.scales:
        assert torch.equal(s.cpu(), torch.tensor([[0.25] * kvh, [0.125] * kvh]))
    per_head_k = torch.arange(1, kvh + 1, dtype=torch.float32) / 10
    heads = _with_scales(src, str(tmp_path / "heads"), per_head_k, torch.tensor([0.5]))
    llm = _llm(heads, kv_cache_dtype="fp8")
    assert torch.equal(_runner(llm).kv_layout.scales[0][0].cpu(), per_head_k)
    assert _run(llm, _prompts(1))[0][0]
    plain = _llm(heads)
    assert _runner(plain).kv_layout.scales == []
    bad = _with_scales(src, str(tmp_path / "bad"), torch.ones(kvh + 1), torch.tensor(1.0))
    with pytest.raises(ValueError, match="k_scale"):
        _llm(bad, kv_cache_dtype="fp8")


def test_bad_settings_are_refused_with_the_field_named(tiny_models):
    path = tiny_models("llama")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        _llm(path, kv_cache_dtype="fp16")
    with pytest.raises(ValueError, match="calculate_kv_scales"):
        _llm(path, calculate_kv_scales=True)
    # the alias is the same cache
    llm = _llm(path, kv_cache_dtype="fp8_e4m3")
    assert _runner(llm).kv_caches[0].dtype == torch.float8_e4m3fn


def test_tensor_parallel_ranks_take_their_heads_scales(tiny_models, tmp_path):
    """TP = 2 (two gloo worker processes, a KV head each) with per-KV-head checkpoint scales
    far apart (one head's K clips at 448 x 0.02): each rank quantizes its own head with its
    own scale, so the tokens equal one rank's; a rank given the other head's scale would
    not. And a speculative (ngram) engine over the fp8 cache keeps the plain one's tokens."""
    src = tiny_models("llama")
    path = _with_scales(
        src, str(tmp_path / "tp"), torch.tensor([0.02, 1.0]), torch.tensor([1.0, 0.01])
    )
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    kw = {"kv_cache_dtype": "fp8", "max_num_batched_tokens": 16, "device": "cpu"}

    def tokens(llm: LLM) -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    one = tokens(_llm(path, **kw))
    assert tokens(_llm(path, tensor_parallel_size=2, **kw)) == one
    swapped = _with_scales(
        src, str(tmp_path / "swapped"), torch.tensor([1.0, 0.02]), torch.tensor([0.01, 1.0])
    )
    assert tokens(_llm(swapped, **kw)) != one  # the scales matter: the test can fail
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    assert tokens(_llm(path, speculative_config=spec, **kw)) == one


@pytest.mark.parametrize(
    "engine_kw",
    [dict(max_num_batched_tokens=16),
     dict(block_size=8, num_gpu_blocks_override=70, preemption_mode="swap", swap_space=0.01)],
    ids=["chunked", "swap"],
)  # fmt: skip
def test_kv_compress_over_fp8(tiny_models, engine_kw):
    """KV-Compress keeps its per-head blocks in fp8 (``kvcompress/attention.py``): without
    eviction it gives the plain fp8 cache's tokens and logprobs (the same bytes, scales set
    from the same first step), also through chunked prefill and swap preemption (whole
    blocks moved as bytes); with a budget it evicts and compacts the fp8 blocks, keeps the
    budget and its tables whole (``check_integrity``)."""
    path = tiny_models("llama")
    prompts = _prompts()
    kw = dict(kv_cache_dtype="fp8", calculate_kv_scales=True, **engine_kw)
    plain_llm = _llm(path, **kw)
    kvc = _llm(path, enable_kvc=True, **kw)
    for llm in (plain_llm, kvc):  # a GPU's memory-profiling pass, which a CPU engine skips:
        _profiling_pass(llm)  # its dummy tokens never calibrate (they would clamp real keys)
    top2 = dict(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    ids = [{"prompt_token_ids": p} for p in prompts]
    plain = plain_llm.generate(ids, SamplingParams(**top2), use_tqdm=False)
    got = kvc.generate(ids, SamplingParams(**top2, max_cache_tokens=200), use_tqdm=False)
    runner = _runner(kvc)
    assert runner.kv_layout.kv.dtype == torch.float8_e4m3fn
    scales = runner.kv_layout.kv_scales.scales
    assert all(not bool((s == 1).all()) for s in scales)
    # the same first step calibrates both: the same scales (on the CPU within a float32
    # rounding: on an AVX-512 EPYC two of the four came out 1 ulp apart, the keys' sums
    # rounded otherwise in the two engines, where the AVX2 CPUs before gave equal bits; on a
    # GPU each layout's own rope-and-write kernel rounds the keys its max comes from). Dummy
    # tokens would give scales nowhere near these.
    cpu = runner.device.type == "cpu"
    for a, b in zip(_runner(plain_llm).kv_layout.scales, scales, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6 if cpu else 1e-3, atol=0)
    # On the CPU: the same tokens and logprobs. On a GPU the plain Triton kernel also reads an
    # fp8 cache with the query rounded to float16, KV-Compress's kernels in the query's dtype
    # (float32 here): logprobs a rounding apart, and where the top two of a tiny random
    # model's tokens are closer than that (the H100: 397 over 312 by 0.009 in one engine,
    # 312 over 397 by 0.002 in the other), greedy may part there: each token is then the
    # other's runner-up, within the gap, and the rest of the sequence is not compared.
    atol = 1e-4 if cpu else 2e-2
    for a, b in zip(plain, got):
        a, b = a.outputs[0], b.outputs[0]
        for j, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids)):
            la, lb = a.logprobs[j], b.logprobs[j]
            if ta != tb:
                assert not cpu and tb in la and ta in lb, (j, ta, tb)
                assert abs(la[ta].logprob - la[tb].logprob) < 2 * atol
                assert abs(lb[ta].logprob - lb[tb].logprob) < 2 * atol
                break
            assert abs(la[ta].logprob - lb[tb].logprob) < atol, (j, la[ta], lb[tb])
    if "swap_space" in engine_kw:
        assert kvc.llm_engine.engine_core.scheduler.num_preemptions > 0
    tight = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                           max_cache_tokens=12, protected_window_size=4)  # fmt: skip
    outs = kvc.generate([{"prompt_token_ids": p} for p in prompts], tight, use_tqdm=False)
    kvc.llm_engine.engine_core.check_integrity()
    kv = kvc.llm_engine.engine_core.scheduler.kv_cache_manager
    assert kv.num_evicted_kvs > 0 and all(len(o.outputs[0].token_ids) == 24 for o in outs)
