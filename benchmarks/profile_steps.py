"""Where a decode step's time goes on the GPU, synchronous vs async scheduling: torch.profiler
over a short Qwen3-0.6B-shaped run (random weights), printing the CUDA runtime calls that
block the host and the kernels by device time. Usage: python benchmarks/profile_steps.py"""

from __future__ import annotations

import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from pagedllm import LLM, SamplingParams


def main() -> None:
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(100, 150000, 700).tolist()} for _ in range(256)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    for asynch in (False, True):
        llm = LLM(
            "qwen3-0.6b",
            load_format="dummy",
            dtype="bfloat16",
            max_model_len=2048,
            gpu_memory_utilization=0.6,
            async_scheduling=asynch,
        )
        llm.generate(prompts[:16], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        llm.generate(prompts, params, use_tqdm=False)  # warm every graph size
        torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        plain = time.perf_counter() - t
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            llm.generate(prompts, params, use_tqdm=False)
            torch.cuda.synchronize()
        print(f"=== async={asynch}: {plain:.3f} s unprofiled for 256 x 48 tokens")
        ka = prof.key_averages()
        rows = sorted(ka, key=lambda e: e.self_cpu_time_total, reverse=True)
        print("host (self CPU ms):")
        for e in rows[:22]:
            print(f"  {e.key[:60]:60s} n={e.count:6d} {e.self_cpu_time_total / 1e3:9.1f}")
        kern = sorted(ka, key=lambda e: e.self_device_time_total, reverse=True)
        print("device (ms):")
        for e in kern[:14]:
            print(f"  {e.key[:60]:60s} n={e.count:6d} {e.self_device_time_total / 1e3:9.1f}")
        del llm
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
