"""KV-Compress with tensor parallelism on the CPU (two worker processes, gloo): each rank
holds and evicts its own KV heads, budgets stay per request over every head.

- Without eviction (a budget above every request's length) the greedy tokens are those of
  one rank with KV-Compress and of one rank without it.
- With eviction the ranks choose the cheapest chunks across every rank's heads, as one rank
  does: each eviction leaves every (layer, KV head) the length it has on one rank, the
  kept KVs meet the budget rule, the tokens are one rank's, and every block of every rank's
  pool is free once the requests are done.
- A model with fewer KV heads than ranks (a KV head on several ranks) is refused.

fp32 tiny random models: the ranks' partial sums are added in another order than one rank's
matmul, so scores differ by float noise only; no chunk cost of these prompts is that close
to another.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.core.kv_cache.head_paged import HeadPagedKVCacheManager


def _prompts(lens: list[int], seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(3, 500, n).tolist()} for n in lens]


def _engine(path: str, tp: int, kvc: bool = True, **kw: object) -> LLM:
    kw.setdefault("kv_cache_memory_bytes", 32 << 20)
    return LLM(path, dtype="float32", device="cpu", tensor_parallel_size=tp, enable_kvc=kvc,
               **kw)  # fmt: skip


def _generate(llm: LLM, prompts: list[dict], params: SamplingParams) -> list[list[int]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    core = llm.llm_engine.engine_core
    core.check_integrity()  # idle: every block of every rank's pool is free
    return [list(o.outputs[0].token_ids) for o in outs]


def test_tp2_without_eviction_equals_one_rank(tiny_models):
    """A budget above every request's length, chunked prefill (a 16-token budget): the tokens
    of one rank with and without KV-Compress, and the per-head manager tables both ranks'
    heads, each rank's from a pool of its own."""
    path = tiny_models("llama")  # 2 KV heads: one on each rank
    prompts = _prompts([3, 17, 40, 33, 8, 64])
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, max_cache_tokens=200)
    kw = {"max_model_len": 256, "max_num_batched_tokens": 16}
    want = _generate(_engine(path, 1, kvc=False, **kw), prompts, plain)
    assert _generate(_engine(path, 1, **kw), prompts, sp) == want
    llm = _engine(path, 2, **kw)
    assert len(llm.llm_engine.engine_core.executor.pids) == 2
    assert _generate(llm, prompts, sp) == want
    kv = llm.llm_engine.engine_core.scheduler.kv_cache_manager
    assert isinstance(kv, HeadPagedKVCacheManager)
    assert kv.num_ranks == 2 and kv.num_heads == 2 * 2 and kv.owner.tolist() == [0, 1, 0, 1]
    assert kv.num_evicted_kvs == 0


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_tp2_evictions_equal_one_rank(tiny_models, monkeypatch, arch):
    """Compression rate 4 on prompts of a few hundred tokens, compressed again while decoding:
    every eviction's per-head lengths equal one rank's (the chunks are chosen across
    both ranks' heads), each keeps the budget (at most ceil(tokens x heads / 4) KVs, less
    than a block below it), and the tokens are one rank's. Gemma 3: the sliding-window
    layers keep their KVs and the budget counts the global layers' heads."""
    applied: dict[int, list] = {1: [], 2: []}
    ranks = [1]
    real = HeadPagedKVCacheManager.apply_compaction

    def record(self, request, lens, computed=None):  # noqa: ANN001, ANN202
        applied[ranks[0]].append((request.request_id, np.asarray(lens).tolist(), computed))
        return real(self, request, lens, computed)

    monkeypatch.setattr(HeadPagedKVCacheManager, "apply_compaction", record)
    path = tiny_models(arch)
    prompts = _prompts([300, 180, 240], seed=1)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, compression_rate=4.0,
                        protected_window_size=4)  # fmt: skip
    want = _generate(_engine(path, 1, max_model_len=512), prompts, sp)
    ranks[0] = 2
    llm = _engine(path, 2, max_model_len=512)
    assert _generate(llm, prompts, sp) == want
    assert applied[2] == applied[1]
    kv = llm.llm_engine.engine_core.scheduler.kv_cache_manager
    heads = int(kv.compressible.sum())
    assert heads < kv.num_heads if arch == "gemma3" else heads == kv.num_heads
    # after each prompt, and again while decoding (whenever a request outgrew its budget)
    prompt_len = {"0": 300, "1": 180, "2": 240}  # (LLM.generate's request ids)
    assert {rid for rid, _, n in applied[2] if n > prompt_len[rid]} == set(prompt_len)
    for _, lens, computed in applied[2]:
        kept = int(np.asarray(lens)[kv.compressible].sum())
        budget = math.ceil(computed * heads / 4)
        assert budget - kv.block_size < kept <= budget
    assert kv.num_compressions == len(applied[2]) and kv.num_evicted_kvs > 0


def test_kv_heads_on_several_ranks_are_refused(tmp_path):
    """One KV head over 2 ranks: each rank would score it with half its query heads."""
    from tests.models.tiny import make_tiny_model

    path = make_tiny_model("llama", str(tmp_path / "m"), num_key_value_heads=1)
    with pytest.raises(ValueError, match=r"enable_kvc needs tensor_parallel_size \(2\)"):
        _engine(path, 2, max_model_len=256)
    _engine(path, 2, kvc=False, max_model_len=256).llm_engine.engine_core.shutdown()
