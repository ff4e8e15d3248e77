"""Where a JSON-constrained batch's time goes on the GPU, against the same batch unconstrained:
host milliseconds per step in each phase of the engine loop (wrapped with timers; no added
syncs), the step's wall time, and the device kernels by time (torch.profiler). Qwen3-0.6B
shape with SmolLM2's vocabulary, random weights, 128 requests, SmolLM2's tokenizer
(``PAGEDLLM_TOKENIZER_DIR``).

Usage: PAGEDLLM_TOKENIZER_DIR=.bench_tok python benchmarks/profile_structured.py
"""

from __future__ import annotations

import cProfile
import functools
import gc
import os
import pstats
import sys
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.gpu_suite import structured_model  # noqa: E402
from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.structured_output.params import StructuredOutputsParams  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "tags"],
}


def _timed(obj: object, name: str, acc: dict) -> None:
    """Replace obj.name by a wrapper that adds its wall time to acc[name]."""
    fn = getattr(obj, name)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[name] += time.perf_counter() - t

    setattr(obj, name, wrapper)


def main() -> None:
    path = structured_model(os.environ["PAGEDLLM_TOKENIZER_DIR"])
    # GRAMMAR_PROCESS=0: the grammars in the engine loop (default: in the worker process)
    process = os.environ.get("GRAMMAR_PROCESS", "1") == "1"
    print(f"grammar_process={process}")
    llm = LLM(path, tokenizer=os.environ["PAGEDLLM_TOKENIZER_DIR"], dtype="bfloat16",
              max_model_len=1024, gpu_memory_utilization=0.85, grammar_process=process)
    engine = llm.llm_engine
    core = engine.engine_core
    core.structured_output_manager()  # the Grammars object, to time its submit and collect
    runner = core.model_runner
    acc: dict = defaultdict(float)
    for obj, names in (
        (runner, ("launch_forward", "launch_sample", "resolve", "_apply_bitmask")),
        (core.scheduler, ("schedule", "update_from_output")),
        (engine.output_processor, ("process_outputs",)),
        (core, ("step", "_submit_grammars", "_collect_grammars")),
        (core.scheduler, ("send_grammar_tokens",)),
    ):
        for name in names:
            _timed(obj, name, acc)
    for name in ("submit",):
        _timed(core.scheduler.grammars, name, acc)
    grammars = core.scheduler.grammars
    collect = grammars.collect

    def timed_collect():  # noqa: ANN202 - the wait, and the worker's own work per step
        t = time.perf_counter()
        step = collect()
        acc["collect (wait)"] += time.perf_counter() - t
        acc["grammar work (worker)"] += step.work_seconds
        return step

    grammars.collect = timed_collect
    import pagedllm.structured_output.bitmask as bitmask_mod  # the kernel launch alone

    _timed(bitmask_mod, "apply_token_bitmask", acc)
    gc_start: dict = {}

    def on_gc(phase: str, info: dict) -> None:  # time spent in Python's collector
        if phase == "start":
            gc_start[info["generation"]] = time.perf_counter()
        else:
            acc[f"gc gen{info['generation']}"] += time.perf_counter() - gc_start[info["generation"]]

    gc.callbacks.append(on_gc)
    prompts = [{"prompt_token_ids": list(range(1000 + i, 1064 + i))} for i in range(128)]
    so = StructuredOutputsParams(json=SCHEMA)
    # the scheduler's update in the last constrained run, function by function
    prof = cProfile.Profile()
    update = core.scheduler.update_from_output

    def profiled_update(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        prof.enable()
        try:
            return update(*args, **kwargs)
        finally:
            prof.disable()

    for i, mode in enumerate(("free", "constrained", "free", "constrained", "constrained")):
        if i == 4:
            core.scheduler.update_from_output = profiled_update
        params = SamplingParams(temperature=1.0, max_tokens=128, ignore_eos=True,
                                structured_outputs=so if mode == "constrained" else None)
        acc.clear()
        torch.cuda.synchronize()
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        el = time.perf_counter() - t
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        steps = max(1, n // len(prompts))
        print(f"=== {mode}: {el:.3f} s, {n} tokens, {n / el:.0f} tok/s, "
              f"{el / steps * 1e3:.2f} ms per step (~{steps} steps)")
        for k, v in sorted(acc.items(), key=lambda kv: -kv[1]):
            print(f"  {k:22s} {v / steps * 1e3:7.3f} ms/step")
    core.scheduler.update_from_output = update
    print("=== the scheduler's update_from_output, last constrained run (cProfile)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(12)
    for mode in ("free", "constrained"):
        params = SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True,
                                structured_outputs=so if mode == "constrained" else None)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            llm.generate(prompts, params, use_tqdm=False)
            torch.cuda.synchronize()
        ka = prof.key_averages()
        print(f"=== {mode} (profiled, 32 tokens): host self CPU ms")
        for e in sorted(ka, key=lambda e: e.self_cpu_time_total, reverse=True)[:16]:
            print(f"  {e.key[:60]:60s} n={e.count:6d} {e.self_cpu_time_total / 1e3:9.1f}")
        print("  device ms")
        for e in sorted(ka, key=lambda e: e.self_device_time_total, reverse=True)[:12]:
            print(f"  {e.key[:60]:60s} n={e.count:6d} {e.self_device_time_total / 1e3:9.1f}")


if __name__ == "__main__":
    main()
