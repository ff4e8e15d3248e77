"""Where the host time of an engine step goes: Benchmark A's workload (Qwen3-0.6B shape, bf16,
256 prompts, input and output lengths uniform in 100-1024) with a wall-clock timer around each
phase of the engine loop, for the default engine and for KV-Compress without a budget (issue
17: its overhead). Under async scheduling the device idles when one loop iteration's host work
(schedule + launch + update + output processing) outlasts one step on the device, so the sum
of the phases per step, against the device time per step, says whether a variant is host-bound.

Phases (ms per step, means over the timed run): ``schedule``, ``launch_forward`` (and inside it
``update_states``, ``prepare_inputs``, ``kvc_prepare_step``, ``forward``; with KV-Compress
``kvc_set_entries`` inside ``update_states`` and ``kvc_step_slots`` inside
``kvc_prepare_step``), ``launch_sample``,
``launch_step`` (forward and sample together, the async path), ``resolve`` (mostly the wait
for the step's tokens), ``update`` (the scheduler's update from
the runner output), ``process_outputs`` (detokenization and request outputs), ``gc`` (time in
Python's garbage collector, from ``gc.callbacks``), ``core_step`` (the engine core's part of an
iteration) and ``loop`` (one whole engine iteration).

    python benchmarks/host_phases.py --out DIR              # on a GPU
    python benchmarks/host_phases.py --variants kvc --gc-off
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

VARIANTS = {"paged": {}, "kvc": {"enable_kvc": True}}


class PhaseTimer:
    """Accumulates wall time per named phase; ``wrap`` replaces an attribute by a timed one."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._gc_t = 0.0

    def wrap(self, obj: Any, attr: str, name: str) -> None:
        fn: Callable = getattr(obj, attr)
        if getattr(vars(obj).get(attr), "_phase_timed", False):  # timed before: time the
            fn = fn.__wrapped__  # original, once

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[name] += time.perf_counter() - t
                self.calls[name] += 1

        timed._phase_timed = True  # type: ignore[attr-defined]
        setattr(obj, attr, timed)

    def wrap_engine(self, llm: Any) -> None:
        """Time the phases of ``llm``'s engine loop (see the module docstring), and the
        runner's where it runs in this process."""
        engine = llm.llm_engine
        core = engine.engine_core
        sched, ex = core.scheduler, core.executor
        for obj, attr, name in [
            (sched, "schedule", "schedule"),
            (ex, "launch_forward", "launch_forward"),
            (ex, "launch_sample", "launch_sample"),
            (ex, "launch_step", "launch_step"),
            (ex, "resolve", "resolve"),
            (sched, "update_from_output", "update"),
            (engine.output_processor, "process_outputs", "process_outputs"),
            (core, "step", "core_step"),
            (engine, "step", "loop"),
        ]:
            self.wrap(obj, attr, name)
        runner = getattr(ex, "runner", None)  # None: the model is in worker processes
        if runner is None:
            return
        self.wrap(runner, "_update_states", "update_states")
        self.wrap(runner.inputs, "prepare", "prepare_inputs")
        self.wrap(runner, "_forward", "forward")
        if runner.kvc is not None:
            self.wrap(runner.kvc, "prepare_step", "kvc_prepare_step")
            self.wrap(runner.kvc, "set_entries", "kvc_set_entries")
            self.wrap(runner.kvc, "_step_slots", "kvc_step_slots")  # (its kernel launches)

    def gc_callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t = time.perf_counter()
        else:
            self.total["gc"] += time.perf_counter() - self._gc_t
            self.calls[f"gc_gen{info['generation']}"] += 1


def run_variant(name: str, args: argparse.Namespace, prompts: list, out_lens: list) -> dict:
    from pagedllm import LLM, SamplingParams
    from pagedllm.bench.throughput import make_workload

    llm = LLM(args.model, load_format="dummy", dtype="bfloat16", max_model_len=2048,
              max_num_seqs=256, gpu_memory_utilization=0.85, **VARIANTS[name])  # fmt: skip
    warm, _ = make_workload(len(prompts), 562, 562, 462 / 562, 151936, seed=1)
    warm = [w[: len(p)] + [7] * (len(p) - len(w)) for w, p in zip(warm, prompts)]

    def params() -> list:
        return [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in out_lens]

    llm.generate([{"prompt_token_ids": p} for p in warm], params(), use_tqdm=False)
    engine = llm.llm_engine
    timer = PhaseTimer()
    timer.wrap_engine(llm)
    if args.gc_off:
        gc.disable()
    gc.callbacks.append(timer.gc_callback)
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params(), use_tqdm=False)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t
    gc.callbacks.remove(timer.gc_callback)
    gc.enable()
    steps = max(timer.calls["schedule"], 1)
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    result = {
        "engine_args": VARIANTS[name],
        "gc_disabled": args.gc_off,
        "elapsed_s": elapsed,
        "output_tokens_per_s": produced / elapsed,
        "steps": steps,
        "wall_ms_per_step": 1e3 * elapsed / steps,
        "ms_per_step": {k: 1e3 * v / steps for k, v in sorted(timer.total.items())},
        "calls": dict(timer.calls),
    }
    del llm, engine
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--variants", default="paged,kvc")
    ap.add_argument("--gc-off", action="store_true", help="gc.disable() during the timed run")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    n = args.num_prompts
    in_lens, out_lens = rng.integers(100, 1025, n), rng.integers(100, 1025, n)
    prompts = [rng.integers(0, 151936, int(k)).tolist() for k in in_lens]
    results = {}
    for name in args.variants.split(","):
        results[name] = run_variant(name, args, prompts, [int(m) for m in out_lens])
        r = results[name]
        print(f"{name}{' gc off' if args.gc_off else ''}: {r['output_tokens_per_s']:.0f} out "
              f"tok/s, wall {r['wall_ms_per_step']:.2f} ms/step", flush=True)  # fmt: skip
        for k, v in r["ms_per_step"].items():
            print(f"   {k:18s} {v:7.3f} ms/step", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        tag = "_gcoff" if args.gc_off else ""
        dev = torch.cuda.get_device_name().replace(" ", "_")
        path = Path(args.out) / f"host_phases{tag}_{dev}.json"
        path.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                    "results": results}, indent=1))  # fmt: skip
        print("wrote", path)


if __name__ == "__main__":
    main()
