"""Tool calling's cost on a GPU: the same prompts decoded freely ("no tools") and under
``tool_choice="required"``'s grammar (the JSON list of calls the server constrains a required
tool call to, built by ``entrypoints/openai/tools.py`` from two function tools), in one
process, output tokens per second of each and their ratio:

    python benchmarks/tools_gpu.py --num-prompts 256 --max-tokens 256 --out DIR

Qwen3-0.6B shape, random bf16 weights, with the vocabulary of the tokenizer in
``PAGEDLLM_TOKENIZER_DIR`` (SmolLM2's, carried in ``.bench_tok/``: the grammar needs a real
vocabulary), prompts of 100-1024 random tokens. The tools' string
arguments have no length bound, so a random model's constrained output runs to ``max_tokens``
like the free one (the run records both token counts). Needs xgrammar (carried as a wheel).
The issue's goal: required >= 0.9x no tools. Each run records its Triton compiles and the
caching allocator's device calls; ``--diagnose`` runs the pair again with the engine loop's
calls timed and CUDA events per step (``HostSpans``), then the grammars in the engine loop.
The JSON lands in DIR as ``tools_required_<device>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.gpu_suite import free_mem, provenance, structured_model  # noqa: E402
from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.bench.throughput import make_workload, time_triton_compiles  # noqa: E402
from pagedllm.entrypoints.openai.tools import parse_tools, resolve_tool_choice  # noqa: E402
from pagedllm.structured_output.params import StructuredOutputsParams  # noqa: E402
from pagedllm.worker.profiler import DeviceTimer  # noqa: E402

TOOLS = [
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"},
                                         "top_k": {"type": "integer"}},
        "required": ["query", "top_k"]}}},
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"},
                                         "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"]}}},
]  # fmt: skip


ALLOC_KEYS = ("num_alloc_retries", "num_device_alloc", "num_device_free")


class HostSpans:
    """Host seconds inside the engine loop's calls that may block a grammar step (wrapped on
    the instances, summed per run): waiting for the grammar worker (``collect``), for the
    device (``resolve``), queueing the sampling and the forward, the scheduler's two calls.
    With ``DeviceTimer``'s device seconds per step they say what a step waits on."""

    def __init__(self, llm: LLM) -> None:
        core = llm.llm_engine.engine_core
        self.seconds: dict[str, float] = {}
        self.work_s = 0.0  # the grammar worker's own accept + fill seconds
        ex, sched = core.executor, core.scheduler
        for name, obj in (("resolve", ex), ("launch_sample", ex), ("launch_forward", ex),
                          ("launch_step", ex), ("execute_model", ex), ("schedule", sched),
                          ("update_from_output", sched)):  # fmt: skip
            self._wrap(obj, name)
        self.grammars = sched.grammar_book

    def _wrap(self, obj: object, name: str) -> None:
        fn = getattr(obj, name)

        def timed(*a, **kw):  # noqa: ANN002, ANN003, ANN202
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t

        setattr(obj, name, timed)

    def wrap_grammars(self) -> None:
        """The grammars exist after the first structured request: wrap their collect."""
        g = self.grammars.grammars
        if g is None or getattr(g, "_timed", False):
            return
        collect = g.collect

        def timed():  # noqa: ANN202
            t = time.perf_counter()
            step = collect()
            self.seconds["grammar_collect"] = (
                self.seconds.get("grammar_collect", 0.0) + time.perf_counter() - t
            )
            self.work_s += step.work_seconds
            return step

        g.collect, g._timed = timed, True

    def reset(self) -> None:
        self.seconds, self.work_s = {}, 0.0


def run(llm: LLM, prompts: list[list[int]], max_tokens: int, grammar: bool,
        spans: HostSpans | None = None) -> dict:  # fmt: skip
    so = None
    if grammar:
        mode = resolve_tool_choice(parse_tools(TOOLS), "required", None, False)
        so = StructuredOutputsParams(json=mode.schema())
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=not grammar,
                            structured_outputs=so)  # fmt: skip
    warm = [[7] * len(p) for p in prompts[:32]]
    with time_triton_compiles() as warm_compiles:
        llm.generate([{"prompt_token_ids": p} for p in warm], params, use_tqdm=False)
    core = llm.llm_engine.engine_core
    timer = None
    if spans is not None:
        spans.wrap_grammars()
        spans.reset()
        timer = core.executor.runner.profiler = DeviceTimer()
    steps0 = core.num_steps
    torch.cuda.synchronize()
    mem0 = torch.cuda.memory_stats()
    with time_triton_compiles() as compiles:  # a kernel variant the warm-up missed stalls
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        torch.cuda.synchronize()
        el = time.perf_counter() - t
    mem1 = torch.cuda.memory_stats()
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    by_length = sum(o.outputs[0].finish_reason == "length" for o in outs)
    out = {"grammar": "tool_choice required" if grammar else "none", "elapsed_s": el,
           "output_tokens": produced, "output_tokens_per_s": produced / el,
           "finished_by_length": by_length, "steps": core.num_steps - steps0,
           "triton_compiles_timed": compiles.count, "triton_compile_s_timed": compiles.seconds,
           "triton_compiled_kernels_timed": dict(compiles.kernels),
           # what the timed run's compiles specialized on, beside the warm-up's (the reason)
           "triton_compile_keys_timed": compiles.keys,
           "triton_compile_keys_warm_up": warm_compiles.keys,
           # the caching allocator's device calls in the run (a cudaFree waits for the device;
           # a retry frees the cache first): the other first-run cost a warm-up may miss
           "allocator_timed": {k: mem1.get(k, 0) - mem0.get(k, 0) for k in ALLOC_KEYS}}  # fmt: skip
    if spans is not None and timer is not None:
        core.executor.runner.profiler = None
        n = max(out["steps"], 1)
        out["diagnosis"] = {
            "wall_ms_per_step": 1e3 * el / n,
            # CUDA events from before a step's forward to after its sampling: with a grammar
            # this includes the device's wait for the bitmask
            "device_ms_per_step": 1e3 * sum(timer.step_seconds) / max(len(timer.step_seconds), 1),
            "host_ms_per_step": {k: 1e3 * v / n for k, v in sorted(spans.seconds.items())},
            "grammar_worker_ms_per_step": 1e3 * spans.work_s / n,
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--diagnose", action="store_true",
                   help="also time the host's calls per step and the device per step (CUDA "
                   "events), and run the grammars in the engine loop too (default: off)")
    args = p.parse_args()
    tok_dir = os.environ["PAGEDLLM_TOKENIZER_DIR"]
    path = structured_model(tok_dir)
    with open(os.path.join(path, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    prompts, _ = make_workload(args.num_prompts, 562, 562, 462 / 562, vocab, seed=0)
    llm = LLM(path, tokenizer=tok_dir, dtype="bfloat16", max_model_len=2048, max_num_seqs=256,
              gpu_memory_utilization=0.85)  # fmt: skip
    runs = [run(llm, prompts, args.max_tokens, g) for g in (False, True)]
    if args.diagnose:  # again, timed, then with the grammars in the engine loop
        spans = HostSpans(llm)
        runs += [run(llm, prompts, args.max_tokens, g, spans) for g in (False, True)]
        del llm
        free_mem()
        llm = LLM(path, tokenizer=tok_dir, dtype="bfloat16", max_model_len=2048,
                  max_num_seqs=256, gpu_memory_utilization=0.85, grammar_process=False)  # fmt: skip
        spans = HostSpans(llm)
        runs.append({**run(llm, prompts, args.max_tokens, True, spans), "grammar_process": False})
    del llm
    free_mem()
    device = torch.cuda.get_device_name()
    ratio = runs[1]["output_tokens_per_s"] / runs[0]["output_tokens_per_s"]
    result = {**provenance("tools-required"), "device": device,
              "workload": {"model": "qwen3-0.6b shape, SmolLM2 vocabulary, random weights, bf16",
                           "num_prompts": args.num_prompts, "input_len": "100-1024",
                           "max_tokens": args.max_tokens, "tools": TOOLS},
              "runs": runs, "ratio_required_to_none": ratio,
              "goal": "required >= 0.9x no tools", "goal_met": ratio >= 0.9}  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"tools_required_{device.replace(' ', '_')}.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(runs, indent=1), "ratio", ratio)


if __name__ == "__main__":
    main()
