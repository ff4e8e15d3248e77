"""What the multiprocess executor costs: the same workload through ``distributed_executor_backend``
"mp" (the model in a worker process, SchedulerOutput and ModelRunnerOutput pickled over a
socket each step) and "uni" (in-process), tokens/s and ms per engine step.

Both engines are built once and live side by side (their KV caches sized by bytes, so the
second does not see the first's memory as taken); each repeat runs the workload on both, the
order alternating. ms/step is the median wall time of ``EngineCore.step()`` over the steps
that scheduled only decodes (under async scheduling a step launches N and resolves N-1).

    # CPU, quick (a tiny random-weight llama):
    .venv/bin/python benchmarks/executor_overhead.py --preset cpu-tiny
    # GPU, Benchmark-A-like (Qwen3-0.6B shape, bf16, 256 prompts, in/out 100-1024 tokens):
    python benchmarks/executor_overhead.py --preset bench-a

Writes ``benchmarks/results/executor_overhead_<preset>[_async_on|off]_<device>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from typing import Any

# Both engines under the CPU worker's OpenMP policy (multiproc_executor.py sets PASSIVE for
# it): else the comparison measures spinning threads, not the executor. Before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.bench.throughput import make_workload  # noqa: E402
from pagedllm.utils.channel import encode  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESETS: dict[str, dict[str, Any]] = {
    # shape, dtype, prompts, input/output centre, range ratio, KV GiB, max_model_len
    "cpu-tiny": dict(
        shape="tiny",
        dtype="float32",
        num_prompts=16,
        input_len=32,
        output_len=64,
        range_ratio=0.5,
        kv_gib=0.25,
        max_model_len=256,
    ),
    "bench-a": dict(
        shape="qwen3-0.6b",
        dtype="bfloat16",
        num_prompts=256,
        input_len=562,
        output_len=562,
        range_ratio=462 / 562,
        kv_gib=30.0,
        max_model_len=2048,
    ),
}


def make_model(shape: str, dtype: str, device: str) -> str:
    """A random-weight model of ``shape``: the tests' tiny llama, or a real configuration
    from pagedllm/model/configs (saved once under /tmp)."""
    if shape == "tiny":
        from tests.models.tiny import make_tiny_model

        path = "/tmp/executor_overhead_tiny_llama"
        if not os.path.exists(os.path.join(path, "config.json")):
            make_tiny_model("llama", path)
        return path
    import transformers as tf

    path = f"/tmp/executor_overhead_{shape}_{dtype}"
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    config = tf.AutoConfig.from_pretrained(os.path.join(ROOT, "pagedllm/model/configs", shape))
    torch.manual_seed(0)
    with torch.device(device):
        model = tf.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(path, safe_serialization=True)
    return path


class StepTimer:
    """Times each ``EngineCore.step()`` and notes whether the step it scheduled was decodes
    only; keeps a few of those plans to measure their pickled size afterwards."""

    def __init__(self, llm: LLM) -> None:
        core = llm.llm_engine.engine_core
        self.records: list[tuple[float, bool]] = []
        self.samples: list[Any] = []
        self._decode = False
        schedule, step = core.scheduler.schedule, core.step

        def timed_schedule():  # noqa: ANN202
            so = schedule()
            n = so.num_scheduled_tokens
            self._decode = bool(n) and max(n.values()) == 1
            if self._decode and len(self.samples) < 8:
                self.samples.append(so)
            return so

        def timed_step():  # noqa: ANN202
            self._decode = False
            t = time.perf_counter()
            out = step()
            self.records.append((time.perf_counter() - t, self._decode))
            return out

        core.scheduler.schedule, core.step = timed_schedule, timed_step


def run_once(llm: LLM, timer: StepTimer, prompts: list, params: list) -> dict:
    timer.records = []
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    decode = [s for s, d in timer.records if d]
    return {
        "elapsed_s": elapsed,
        "output_tokens": produced,
        "output_tokens_per_s": produced / elapsed,
        "steps": len(timer.records),
        "ms_per_step": 1e3 * elapsed / max(len(timer.records), 1),
        "decode_steps": len(decode),
        "decode_ms_per_step_median": 1e3 * float(np.median(decode)) if decode else None,
        "decode_ms_per_step_mean": 1e3 * float(np.mean(decode)) if decode else None,
    }


def device_tag(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name(0).replace(" ", "_")
    model = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return "cpu_" + model.replace(" ", "_")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu-tiny")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--shape", default=None, help="tiny | a folder of pagedllm/model/configs")
    p.add_argument("--model", default=None, help="a model folder (instead of --shape)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--input-len", type=int, default=None)
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--range-ratio", type=float, default=None)
    p.add_argument("--kv-gib", type=float, default=None, help="KV cache of each engine")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--async-scheduling", choices=["auto", "on", "off"], default="auto")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = p.parse_args()
    cfg = dict(PRESETS[args.preset])
    for key in cfg:
        if getattr(args, key, None) is not None:
            cfg[key] = getattr(args, key)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    path = args.model or make_model(cfg["shape"], cfg["dtype"], device)
    asynch = {"auto": None, "on": True, "off": False}[args.async_scheduling]
    engine_kw = dict(
        dtype=cfg["dtype"],
        device=device,
        max_model_len=cfg["max_model_len"],
        max_num_seqs=args.max_num_seqs,
        kv_cache_memory_bytes=int(cfg["kv_gib"] * 2**30),
        async_scheduling=asynch,
    )
    llms = {b: LLM(path, distributed_executor_backend=b, **engine_kw) for b in ("uni", "mp")}
    vocab = llms["uni"].llm_engine.config.model_config.vocab_size
    prompts, out_lens = make_workload(
        cfg["num_prompts"], cfg["input_len"], cfg["output_len"], cfg["range_ratio"], vocab, 0
    )
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in out_lens]
    timers = {b: StepTimer(llm) for b, llm in llms.items()}
    # warm-up: the same lengths, other ids (no prefix-cache hits in the timed runs)
    warm, _ = make_workload(
        cfg["num_prompts"], cfg["input_len"], cfg["output_len"], cfg["range_ratio"], vocab, 1
    )
    warm = [w[: len(q)] + [7] * (len(q) - len(w)) for w, q in zip(warm, prompts)]
    tokens: dict[str, list] = {}
    for b, llm in llms.items():
        run_once(llm, timers[b], warm, params)
    runs: dict[str, list[dict]] = {"uni": [], "mp": []}
    for r in range(args.repeats):
        for b in ("uni", "mp") if r % 2 == 0 else ("mp", "uni"):
            runs[b].append(run_once(llms[b], timers[b], prompts, params))
            print(b, json.dumps(runs[b][-1]), flush=True)
    for b, llm in llms.items():  # a last check that both computed the same tokens
        outs = llm.generate(
            [{"prompt_token_ids": q} for q in prompts[:4]], params[:4], use_tqdm=False
        )
        tokens[b] = [o.outputs[0].token_ids for o in outs]
    sizes = [len(encode(so)) for so in timers["mp"].samples]
    summary = {}
    for b in runs:
        summary[b] = {
            k: float(np.median([x[k] for x in runs[b]]))
            for k in ("output_tokens_per_s", "ms_per_step", "decode_ms_per_step_median")
            if all(x[k] is not None for x in runs[b])
        }
    u, m = summary["uni"], summary["mp"]
    result = {
        "benchmark": "executor_overhead",
        "preset": args.preset,
        "device": device_tag(device),
        "torch": torch.__version__,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "torch_threads": torch.get_num_threads(),
        "load_average_at_end": os.getloadavg(),
        "git_commit": _commit(),
        "workload": {
            **cfg,
            "model": path,
            "output_tokens": sum(out_lens),
            "max_num_seqs": args.max_num_seqs,
        },
        "async_scheduling": llms["uni"].llm_engine.config.scheduler_config.async_scheduling,
        "repeats": args.repeats,
        "order": "alternating, uni first on even repeats",
        "runs": runs,
        "median": summary,
        "mp_minus_uni_decode_ms_per_step": (
            m["decode_ms_per_step_median"] - u["decode_ms_per_step_median"]
            if "decode_ms_per_step_median" in m and "decode_ms_per_step_median" in u
            else None
        ),
        "mp_over_uni_tokens_per_s": m["output_tokens_per_s"] / u["output_tokens_per_s"],
        "decode_scheduler_output_pickled_bytes": sizes,
        "same_tokens": tokens["uni"] == tokens["mp"],
    }
    for llm in llms.values():
        llm.llm_engine.engine_core.shutdown()
    os.makedirs(args.out, exist_ok=True)
    tag = "" if args.async_scheduling == "auto" else f"_async_{args.async_scheduling}"
    name = f"executor_overhead_{args.preset}{tag}_{result['device']}.json"
    out = os.path.join(args.out, name)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(
        json.dumps(
            {
                k: result[k]
                for k in (
                    "median",
                    "mp_minus_uni_decode_ms_per_step",
                    "mp_over_uni_tokens_per_s",
                    "same_tokens",
                )
            },
            indent=1,
        )
    )
    print("wrote", out)


def _commit() -> str | None:
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT, check=False
            ).stdout.strip()
            or None
        )
    except OSError:
        return None


if __name__ == "__main__":
    main()
