"""Gemma-3-270M (the packaged model) with the hybrid KV manager: prompts of 2K tokens, four
times its 512-token window, keep only the window in the sliding layers' tables, and greedy
tokens still equal HF transformers' - with prefix caching (a hit across every group), with a
tiny token budget (chunked prefill) and with a cache small enough to preempt.
(benchmarks/hybrid_kv.py runs the same checks at 2K-8K tokens and measures the memory.)"""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.core.kv_cache.hybrid import HybridKVCacheManager
from tests.models.test_packaged_models import _hf_reference, _path

NEW = 6
LEN = 2048


def text_prompts(path: str, length: int, tails: int, tail_len: int = 40) -> list[list[int]]:
    """Real text (this repository's source, tokenized by the model's tokenizer): ``length``
    tokens shared by every prompt, then a different ``tail_len``-token tail for each."""
    from pathlib import Path

    from pagedllm.model.loader import load_tokenizer

    tok = load_tokenizer(path, None, "gguf")
    root = Path(__file__).resolve().parents[2] / "pagedllm"
    need = length + tails * tail_len
    text = ""  # (enough files for ~8 characters a token, not all 2 MB of them)
    for p in sorted(root.rglob("*.py")):
        text += p.read_text() + "\n"
        if len(text) > 8 * need:
            break
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) >= length + tails * tail_len
    tail = ids[length:]
    return [ids[:length] + tail[i * tail_len : (i + 1) * tail_len] for i in range(tails)]


@pytest.fixture(scope="module")
def gemma():
    path = _path("gemma3")
    prompts = text_prompts(path, LEN, 2)  # the second request can hit the first's prefix
    return path, prompts, _hf_reference(path, prompts, NEW)


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], outs


def test_prefix_hit_across_groups_equals_hf(gemma):
    path, prompts, ref = gemma
    llm = LLM(path, dtype="float32", max_model_len=4096, max_num_batched_tokens=1024)
    core = llm.llm_engine.engine_core
    kv = core.scheduler.kv_cache_manager
    assert isinstance(kv, HybridKVCacheManager) and len(kv.groups) == 6
    first, _ = _generate(llm, prompts[:1])
    second, outs = _generate(llm, prompts[1:])  # after the first finished: a cache hit
    assert first + second == ref
    assert outs[0].num_cached_tokens == LEN  # the whole shared prefix, in every group
    core.check_integrity()


def test_tiny_budget_small_cache_no_caching_equals_hf(gemma):
    path, prompts, ref = gemma
    # 128-token chunks; 450 blocks of 3 layers: one request holds at most 131 (full group) +
    # 5 x 41 (sliding groups), so the two preempt each other
    llm = LLM(
        path,
        dtype="float32",
        max_model_len=4096,
        max_num_batched_tokens=128,
        enable_prefix_caching=False,
        num_gpu_blocks_override=450,
    )
    got, _ = _generate(llm, prompts)
    assert got == ref
    core = llm.llm_engine.engine_core
    assert core.scheduler.num_preemptions > 0
    core.check_integrity()
