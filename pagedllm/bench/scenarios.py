"""``pagedllm bench prefix`` and ``pagedllm bench policy``: the prefix-caching and
scheduling-policy workloads.

prefix: (a) N requests sharing one long prefix with distinct suffixes, all at once;
(b) a multi-turn chat replay where each turn resends the whole conversation. Each runs with
prefix caching on and off; reported: throughput, TTFT, hit rate.

policy: a Poisson stream of short and long requests under load, run under fcfs and sjf;
reported: mean and p99 latency of the short requests, worst latency of the long ones.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import numpy as np

from pagedllm.bench._flags import add_device, add_dtype, add_load_format
from pagedllm.bench.replay import TimedRequest, replay, summarize
from pagedllm.bench.throughput import device_name
from pagedllm.sampling_params import SamplingParams


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``pagedllm bench prefix`` and ``pagedllm bench policy`` (one set: a flag
    that only one of them reads says which)."""
    p.add_argument("--model", required=True, help="HF model folder or .gguf file (required).")
    add_dtype(p)
    add_device(p)
    add_load_format(p)
    p.add_argument(
        "--max-model-len", type=int, default=2048, metavar="N", help="Context length of the engine."
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        metavar="N",
        help="Seed of the random prompts, arrivals and engine.",
    )
    p.add_argument(
        "--num-requests",
        type=int,
        default=32,
        metavar="N",
        help="prefix: requests sharing the one long prefix.",
    )
    p.add_argument(
        "--prefix-len",
        type=int,
        default=341,
        metavar="N",
        help="prefix: tokens of the shared prefix (and of the chat's system prompt).",
    )
    p.add_argument(
        "--suffix-len",
        type=int,
        default=16,
        metavar="N",
        help="prefix: distinct tokens after the prefix (and per user turn).",
    )
    p.add_argument(
        "--output-len",
        type=int,
        default=32,
        metavar="N",
        help="prefix: tokens generated per request (and per assistant turn).",
    )
    p.add_argument(
        "--turns", type=int, default=4, metavar="N", help="prefix: turns of each replayed chat."
    )
    p.add_argument(
        "--conversations",
        type=int,
        default=8,
        metavar="N",
        help="prefix: chats replayed side by side.",
    )
    p.add_argument(
        "--rate",
        type=float,
        default=4.0,
        metavar="REQ_PER_S",
        help="policy: arrivals per second (Poisson; 80%% short requests of 32 "
        "prompt and 16 output tokens, 20%% long ones).",
    )
    p.add_argument(
        "--duration",
        type=float,
        default=20.0,
        metavar="SECONDS",
        help="policy: seconds of arrivals.",
    )
    p.add_argument(
        "--long-input-len",
        type=int,
        default=1024,
        metavar="N",
        help="policy: prompt tokens of a long request (it generates 64).",
    )
    p.add_argument(
        "--out",
        default="benchmarks/results",
        metavar="DIR",
        help="Folder of the result JSON and PNG.",
    )
    p.add_argument(
        "--name",
        default=None,
        metavar="STEM",
        help="Result file stem (default: the benchmark and the model's name, e.g. prefix_MODEL).",
    )


def _engine(args: argparse.Namespace, **kw: Any):  # noqa: ANN202
    from pagedllm.config import EngineArgs
    from pagedllm.engine.llm_engine import LLMEngine

    ea = EngineArgs(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        load_format=args.load_format,
        max_model_len=args.max_model_len,
        seed=args.seed,
        **kw,
    )
    return LLMEngine.from_engine_args(ea)


def _vocab(engine) -> int:  # noqa: ANN001
    return engine.config.model_config.vocab_size


def shared_prefix_run(args: argparse.Namespace, caching: bool) -> dict:
    engine = _engine(args, enable_prefix_caching=caching)
    rng = np.random.default_rng(args.seed)
    v = _vocab(engine)
    prefix = rng.integers(100, v - 100, size=args.prefix_len).tolist()
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    _warm(engine)
    reqs = [
        TimedRequest(
            f"p{i}", prefix + rng.integers(100, v - 100, size=args.suffix_len).tolist(), params
        )
        for i in range(args.num_requests)
    ]
    timings, wall = replay(engine, reqs)
    return _report(engine, timings, wall, args.output_len * args.num_requests)


def chat_replay_run(args: argparse.Namespace, caching: bool) -> dict:
    engine = _engine(args, enable_prefix_caching=caching)
    rng = np.random.default_rng(args.seed + 1)
    v = _vocab(engine)
    system = rng.integers(100, v - 100, size=args.prefix_len).tolist()
    convs = [list(system) for _ in range(args.conversations)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    _warm(engine)
    all_timings, wall = [], 0.0
    for turn in range(args.turns):
        reqs = []
        for c, hist in enumerate(convs):
            hist.extend(rng.integers(100, v - 100, size=args.suffix_len).tolist())  # user
            reqs.append(TimedRequest(f"c{c}t{turn}", list(hist), params))
        timings, w = replay(engine, reqs)
        wall += w
        for t in timings:
            convs[int(t.request_id[1:].split("t")[0])].extend(t.token_ids)  # assistant
        all_timings += timings
    n_out = args.output_len * args.conversations * args.turns
    return _report(engine, all_timings, wall, n_out)


def _warm(engine) -> None:  # noqa: ANN001
    engine.add_request(
        "warm", {"prompt_token_ids": [101, 102, 103]}, SamplingParams(max_tokens=2, ignore_eos=True)
    )
    while engine.has_unfinished_requests():
        engine.step()


def _report(engine, timings, wall: float, n_out: int) -> dict:  # noqa: ANN001
    kv = engine.engine_core.scheduler.kv_cache_manager
    return {
        "wall_s": wall,
        "output_tokens_per_s": n_out / wall,
        "requests_per_s": len(timings) / wall,
        "hit_rate": kv.prefix_cache_hits / max(1, kv.prefix_cache_queries),
        "cached_tokens": sum(t.num_cached_tokens for t in timings),
        **summarize(timings),
    }


def run_prefix(args: argparse.Namespace) -> dict:
    result: dict[str, Any] = {"bench": "prefix", "model": args.model, "workload": vars(args)}
    for name, fn in (("shared_prefix", shared_prefix_run), ("chat_replay", chat_replay_run)):
        on, off = fn(args, True), fn(args, False)
        result[name] = {
            "caching_on": on,
            "caching_off": off,
            "throughput_ratio": on["output_tokens_per_s"] / off["output_tokens_per_s"],
            "ttft_mean_ratio": off["ttft_mean_s"] / on["ttft_mean_s"],
        }
    return result


def run_policy(args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(args.seed)
    arrivals = np.cumsum(rng.exponential(1.0 / args.rate, size=int(args.rate * args.duration)))
    kinds = rng.random(len(arrivals)) < 0.8
    result: dict[str, Any] = {"bench": "policy", "model": args.model, "workload": vars(args)}
    for policy in ("fcfs", "sjf"):
        engine = _engine(args, scheduling_policy=policy, max_num_seqs=8, max_num_batched_tokens=512)
        v = _vocab(engine)
        _warm(engine)
        r2 = np.random.default_rng(args.seed + 7)
        reqs = []
        for i, (t, short) in enumerate(zip(arrivals, kinds)):
            n_in, n_out = (32, 16) if short else (args.long_input_len, 64)
            reqs.append(
                TimedRequest(
                    f"r{i}",
                    r2.integers(100, v - 100, size=n_in).tolist(),
                    SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True),
                    float(t),
                    kind="short" if short else "long",
                )
            )
        timings, wall = replay(engine, reqs)
        result[policy] = {
            "wall_s": wall,
            "short": summarize([t for t in timings if t.kind == "short"]),
            "long": summarize([t for t in timings if t.kind == "long"]),
        }
    return result


def write(result: dict, args: argparse.Namespace, kind: str) -> str:
    import torch

    result["device"] = device_name(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    result["time"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    os.makedirs(args.out, exist_ok=True)
    stem = args.name or f"{kind}_{os.path.basename(args.model.rstrip('/'))}"
    path = os.path.join(args.out, f"{stem}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2, default=str)
    _plot(result, kind, path[:-5] + ".png")
    return path


def _plot(result: dict, kind: str, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    if kind == "prefix":
        names = ["shared_prefix", "chat_replay"]
        x = np.arange(len(names))
        for j, mode in enumerate(("caching_off", "caching_on")):
            ax.bar(
                x + 0.35 * j,
                [result[n][mode]["output_tokens_per_s"] for n in names],
                0.35,
                label=mode.replace("_", " "),
            )
        ax.set_xticks(x + 0.175, names)
        ax.set_ylabel("output tokens/s")
    else:
        labels = ["short mean", "short p99", "long max"]
        x = np.arange(len(labels))
        for j, pol in enumerate(("fcfs", "sjf")):
            r = result[pol]
            vals = [
                r["short"]["latency_mean_s"],
                r["short"]["latency_p99_s"],
                r["long"]["latency_max_s"],
            ]
            ax.bar(x + 0.35 * j, vals, 0.35, label=pol)
        ax.set_xticks(x + 0.175, labels)
        ax.set_ylabel("latency (s)")
    ax.set_title(f"pagedllm bench {kind} ({result['device']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
