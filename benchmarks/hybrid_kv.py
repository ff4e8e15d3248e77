"""Gemma-3-270M with the hybrid KV manager: exactness at 2K-8K tokens and the memory it saves.

Two parts, one JSON (``benchmarks/results/hybrid_kv_gemma3-270m_<device>.json``):

1. ``memory`` (no model; the real scheduler and KV managers, bf16 Gemma-3-270M pages): KV
   bytes held by one 8K-token request at the end of its prefill and at its last decode step,
   hybrid against one table for every layer (``disable_hybrid_kv_cache_manager``), beside the
   expected ratio (3 + 15 x (512 + chunk) / 8192) / 18; and how many 8K-token requests run at
   once in a fixed KV budget (the most running at any step of a whole run, fake tokens).
2. ``exactness`` (the packaged model, fp32, this machine): greedy tokens of prompts of
   2K / 4K / 8K tokens of real text (this repository's source) against HF transformers on the
   same dequantized weights, hybrid on and off, plus at 8K a tiny token budget with prefix
   caching off; and the KV bytes the real engine holds right after the prefill, hybrid and not.

Usage::

    PYTHONPATH=. .venv/bin/python benchmarks/hybrid_kv.py [--lengths 2048,4096,8192] [--skip-model]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.kv_cache.spec import FullAttentionSpec, SlidingWindowSpec, group_layers
from pagedllm.core.request import Request
from pagedllm.core.sched.output import ModelRunnerOutput
from pagedllm.core.sched.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results"
BS = 16


def gemma_groups(hybrid: bool, dtype_bytes: int = 2, window: int = 512, layers: int = 18):
    """Gemma-3-270M's layers: full attention every sixth, window 512 elsewhere; 1 KV head of
    256."""
    full = FullAttentionSpec(BS, 1, 256, dtype_bytes)
    sw = SlidingWindowSpec(BS, 1, 256, dtype_bytes, sliding_window=window)
    return group_layers([full if i % 6 == 5 else sw for i in range(layers)], hybrid=hybrid)


def _scheduler(groups, num_blocks: int, chunk: int, max_seqs: int = 256) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=chunk, max_num_seqs=max_seqs, max_model_len=32768),
        CacheConfig(block_size=BS, enable_prefix_caching=False),
        num_blocks,
        kv_groups=groups,
    )


def _fake_step(s: Scheduler) -> int:
    """One step with a fake runner (token 7 for every row that samples); returns the blocks
    in use once the step was scheduled (its peak)."""
    so = s.schedule()
    kv = s.kv_cache_manager
    used = kv.num_blocks - kv.num_free_blocks() - int(kv.block_pool.null_block is not None)
    ids, toks = [], []
    for rid in so.num_scheduled_tokens:
        r = s.requests[rid]
        ids.append(rid)
        toks.append([7] if r.num_computed_tokens == r.num_tokens else [])
    s.update_from_output(so, ModelRunnerOutput(req_ids=ids, sampled_token_ids=toks))
    return used


def _request(i: int, prompt: int, out: int) -> Request:
    return Request(
        f"r{i}",
        list(range(i * 100_000, i * 100_000 + prompt)),
        SamplingParams(max_tokens=out, ignore_eos=True),
    )


def memory(prompt: int = 8192, out: int = 128, chunk: int = 2048, budget_gib: float = 1.0) -> dict:
    res: dict = {"prompt_tokens": prompt, "output_tokens": out, "chunk": chunk, "dtype": "bf16"}
    for name, hybrid in (("hybrid", True), ("single_table", False)):
        groups = gemma_groups(hybrid)
        # one request alone: bytes held after its prefill and at its last step
        s = _scheduler(groups, 100_000, chunk)
        s.add_request(_request(0, prompt, out))
        held = []
        while s.has_unfinished_requests():
            held.append(_fake_step(s))
        num_prefill_steps = -(-prompt // chunk)  # the last of them samples the first token
        res[name] = {
            "groups": groups.num_groups,
            "layers_per_group": groups.layers_per_group,
            "block_bytes": groups.block_bytes,
            "bytes_after_prefill": max(held[:num_prefill_steps]) * groups.block_bytes,
            "bytes_at_last_step": held[-1] * groups.block_bytes,
        }
        # concurrency in a fixed budget: 64 requests, the most running at once
        num_blocks = int(budget_gib * 2**30 // groups.block_bytes)
        s = _scheduler(groups, num_blocks, chunk)
        for i in range(64):
            s.add_request(_request(i + 1, prompt, out))
        most = steps = 0
        t0 = time.perf_counter()
        while s.has_unfinished_requests():
            _fake_step(s)
            most = max(most, len(s.running))
            steps += 1
        res[name].update(
            {
                "kv_budget_gib": budget_gib,
                "num_blocks": num_blocks,
                "max_concurrent_8k_requests": most,
                "steps_for_64_requests": steps,
                "preemptions": s.num_preemptions,
                "scheduler_seconds": round(time.perf_counter() - t0, 2),
            }
        )
    h, f = res["hybrid"], res["single_table"]
    res["ratio_after_prefill"] = h["bytes_after_prefill"] / f["bytes_after_prefill"]
    res["ratio_at_last_step"] = h["bytes_at_last_step"] / f["bytes_at_last_step"]
    res["expected_ratio"] = (3 + 15 * (512 + chunk) / prompt) / 18
    res["expected_ratio_decode"] = (3 + 15 * (512 + 1) / prompt) / 18
    res["concurrency_gain"] = h["max_concurrent_8k_requests"] / f["max_concurrent_8k_requests"]
    return res


def exactness(lengths: list[int], new: int) -> list[dict]:
    from pagedllm import LLM
    from tests.models.test_hybrid_gemma3 import text_prompts
    from tests.models.test_packaged_models import _hf_reference, _path

    path = _path("gemma3")
    rows = []
    for n in lengths:
        prompt = text_prompts(path, n - 40, 1)[0]  # this repository's source, n tokens
        t0 = time.perf_counter()
        ref = _hf_reference(path, [prompt], new)[0]
        hf_s = time.perf_counter() - t0
        variants = [("hybrid", {}), ("single_table", {"disable_hybrid_kv_cache_manager": True})]
        if n == max(lengths):
            variants.append(
                (
                    "hybrid_budget256_nocache",
                    {"max_num_batched_tokens": 256, "enable_prefix_caching": False},
                )
            )
        for name, kw in variants:
            llm = LLM(path, dtype="float32", max_model_len=n + 64, **kw)
            engine = llm.llm_engine
            kv = engine.engine_core.scheduler.kv_cache_manager
            block_bytes = engine.engine_core.executor.runner.kv_bytes_per_block()
            params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
            t0 = time.perf_counter()
            engine.add_request("x", {"prompt_token_ids": prompt}, params)
            tokens: list[int] = []
            null = int(kv.block_pool.null_block is not None)
            most_held = 0  # blocks the request holds after a step (its peak: the prefill's end)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    tokens = out.outputs[0].token_ids
                most_held = max(most_held, kv.num_blocks - kv.num_free_blocks() - null)
            rows.append(
                {
                    "prompt_tokens": n,
                    "variant": name,
                    "equal_to_hf": tokens == ref,
                    "tokens": tokens,
                    "hf_tokens": ref,
                    "kv_bytes_after_prefill": most_held * block_bytes,
                    "engine_s": round(time.perf_counter() - t0, 1),
                    "hf_s": round(hf_s, 1),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
            del llm, engine
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="2048,4096,8192")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--skip-model", action="store_true")
    args = ap.parse_args()
    res: dict = {
        "device": f"cpu {platform.processor() or platform.machine()}",
        "model": "Gemma-3-270M (packaged GGUF, dequantized)",
    }
    res["memory"] = memory()
    print(json.dumps(res["memory"], indent=1), flush=True)
    out = RESULTS / "hybrid_kv_gemma3-270m_cpu.json"
    if not args.skip_model:
        res["exactness"] = exactness([int(x) for x in args.lengths.split(",")], args.new_tokens)
    elif out.exists():  # keep the last model run's part
        res["exactness"] = json.loads(out.read_text()).get("exactness")
    RESULTS.mkdir(exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    print("wrote", out)


if __name__ == "__main__":
    main()
