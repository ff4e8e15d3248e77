"""``LLM(..., data_parallel_size=2)`` (issue 20: the same flags offline as in the server): two
engine core processes behind the offline API give one engine's greedy outputs, in input order,
both cores serve, bad input raises before anything runs, metrics come from both cores, and
shutting it down leaves no core process."""

from __future__ import annotations

import os

import numpy as np
import pytest

from pagedllm import LLM, SamplingParams


def _kw() -> dict:
    return {"dtype": "float32", "device": "cpu", "seed": 0, "max_model_len": 256,
            "num_gpu_blocks_override": 160}  # fmt: skip


def test_dp2_offline_equals_one_engine(tiny_models) -> None:  # noqa: ANN001
    path = tiny_models("llama")
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, 500, int(n)).tolist()}
               for n in rng.integers(4, 40, 10)]  # fmt: skip
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = LLM(path, **_kw()).generate(prompts, sp, use_tqdm=False)
    llm = LLM(path, data_parallel_size=2, **_kw())
    engine = llm.llm_engine
    try:
        got = llm.generate(prompts, sp, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
        assert all(n > 0 for n in engine.llm.router.routed), engine.llm.router.routed
        metrics = {m.name: m for m in llm.get_metrics()}
        assert metrics["pagedllm:kv_cache_total_blocks"].value == 2 * 160  # both cores'
        assert metrics["pagedllm:engine_steps"].value > 0
        with pytest.raises(ValueError, match="max_tokens"):
            llm.generate(prompts[:2], [sp, SamplingParams(max_tokens=-1)], use_tqdm=False)
        # the engine serves on after the refusal
        again = llm.generate(prompts[:1], sp, use_tqdm=False)
        assert again[0].outputs[0].token_ids == want[0].outputs[0].token_ids
        pids = [c.core.pid for c in engine.llm.cores]
    finally:
        engine.shutdown()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
