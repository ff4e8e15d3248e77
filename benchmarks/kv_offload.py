"""The host KV tier (``kv_offloading_size``) on a multi-turn chat replay: TTFT and throughput
with the tier off, on, and with the whole working set in the device pool (the ceiling).

The workload (seeded random token ids): ``--conversations`` conversations of ``--turns``
turns; every conversation starts with the same ``--system-len``-token system prompt and its own
``--turn-len``-token message; each later turn's prompt is the previous prompt, its answer
(``--output-len`` tokens, EOS ignored) and a new ``--turn-len``-token message. ``--concurrency``
clients take the conversations in turn (round robin: a conversation's next turn comes after
every other conversation's turn, so its history has left a pool smaller than the working set
by then; a user reading and typing), each with one request in flight, so TTFT includes
queueing; the throughput is output tokens over the replay's time.

The device pool holds ``--pool-fraction`` of the working set (the system prompt once, plus
every conversation's last prompt and answer), in blocks (``num_gpu_blocks_override``: the same
tokens on any device); the tier gets the whole working set plus a quarter (in GiB, from the
model's KV bytes per token); the ceiling's pool holds it all. Each mode runs in its own process.

    python benchmarks/kv_offload.py --model qwen3-0.6b --load-format dummy --device cuda
    python benchmarks/kv_offload.py --model TINY_DIR --conversations 8 --turns 3 \\
        --system-len 256 --turn-len 32 --output-len 8 --device cpu      # a CPU smoke run

Writes ``kv_offload_<model>_<device>.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from collections import deque
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BLOCK = 16


def working_set_tokens(a: argparse.Namespace) -> int:
    """The system prompt once plus each conversation's tokens after it at its last turn."""
    per_conv = a.turns * (a.turn_len + a.output_len)
    return a.system_len + a.conversations * per_conv


def kv_bytes_per_token(args: Any) -> int:
    """K and V of every layer for one token: the engine config's model shape and dtype."""
    import torch

    mc = args.create_engine_config().model_config
    elem = torch.empty(0, dtype=mc.torch_dtype).element_size()
    return 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * elem


def replay(a: argparse.Namespace, mode: str) -> dict:
    """One mode's replay in this process: the engine, the closed loops, the numbers."""
    from pagedllm import SamplingParams
    from pagedllm.config import EngineArgs
    from pagedllm.engine.llm_engine import LLMEngine

    ws = working_set_tokens(a)
    pool_tokens = (
        ws + a.conversations * BLOCK * 2 if mode == "ceiling" else int(ws * a.pool_fraction)
    )
    args = EngineArgs(
        model=a.model,
        load_format=a.load_format,
        dtype=a.dtype,
        device=a.device,
        seed=0,
        max_model_len=a.max_model_len,
        max_num_seqs=a.concurrency,
        num_gpu_blocks_override=max(pool_tokens // BLOCK, 1),
        enable_prefix_caching=True,
    )
    per_token = kv_bytes_per_token(args)
    if mode == "on":
        args = replace(args, kv_offloading_size=1.25 * ws * per_token / 2**30)
    engine = LLMEngine.from_engine_args(args)
    vocab = engine.input_processor.vocab_size
    rng = np.random.default_rng(a.seed)

    def text(n: int) -> list[int]:
        return rng.integers(10, min(vocab, 30000), size=n).tolist()

    system = text(a.system_len)
    params = SamplingParams(temperature=0.0, max_tokens=a.output_len, ignore_eos=True)
    convs = [system + text(a.turn_len) for _ in range(a.conversations)]
    turn = [0] * a.conversations
    sent: dict[str, float] = {}  # request -> when it was sent
    ttft: list[float] = []
    out_tokens = 0

    def submit(c: int) -> None:
        rid = f"{c}-{turn[c]}"
        sent[rid] = time.perf_counter()
        engine.add_request(rid, {"prompt_token_ids": convs[c]}, params, output_kind="delta")

    # warm-up: one short request (compiles, graphs), not timed
    engine.add_request("warm", {"prompt_token_ids": text(32)}, params)
    while engine.has_unfinished_requests():
        engine.step()
    t0 = time.perf_counter()
    ready = deque(range(a.conversations))  # conversations whose next turn may go, in turn
    for _ in range(min(a.concurrency, a.conversations)):
        submit(ready.popleft())
    answers: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            rid = o.request_id
            toks = list(o.outputs[0].token_ids)
            if toks and rid in sent:  # its first tokens
                ttft.append(time.perf_counter() - sent.pop(rid))
            answers.setdefault(rid, []).extend(toks)
            if o.finished:
                c = int(rid.split("-")[0])
                out_tokens += len(answers[rid])
                turn[c] += 1
                if turn[c] < a.turns:
                    convs[c] = convs[c] + answers.pop(rid) + text(a.turn_len)
                    ready.append(c)
                if ready:  # the client takes the next conversation's turn
                    submit(ready.popleft())
    elapsed = time.perf_counter() - t0
    stats = engine.engine_core.stats()
    prompt_tokens = sum(len(convs[c]) for c in range(a.conversations))  # (last turns only)
    result = {
        "mode": mode,
        "device": _device_name(a.device),
        "pool_tokens": pool_tokens,
        "working_set_tokens": ws,
        "kv_bytes_per_token": per_token,
        "tier_gib": args.kv_offloading_size or 0.0,
        "requests": len(ttft),
        "elapsed_s": elapsed,
        "output_tokens_per_s": out_tokens / elapsed,
        "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_p99_s": float(np.percentile(ttft, 99)),
        "ttft_mean_s": float(np.mean(ttft)),
        "prefix_cache_hit_rate": stats.get("prefix_cache_hits", 0)
        / max(stats.get("prefix_cache_queries", 0), 1),
        "last_prompt_tokens_mean": prompt_tokens / a.conversations,
        "preemptions": stats.get("num_preemptions", 0),
    }
    result.update({k: v for k, v in stats.items() if k.startswith("offload_")})
    return result


def _device_name(device: str) -> str:
    """The GPU's name, or the CPU's model name (as the CPU benchmarks name their files)."""
    import re

    import torch

    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    from benchmarks.throughput import device_info

    cpu = re.sub(r"\((R|TM)\)", "", device_info().get("cpu_model", "cpu"))
    return re.sub(r"[^A-Za-z0-9]+", "_", cpu).strip("_")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8, help="clients (requests in flight)")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--system-len", type=int, default=2000)
    ap.add_argument("--turn-len", type=int, default=200)
    ap.add_argument("--output-len", type=int, default=100)
    ap.add_argument("--pool-fraction", type=float, default=0.25)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--modes", default="off,on,ceiling")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = ap.parse_args()
    runs: dict[str, dict] = {}
    ctx = multiprocessing.get_context("spawn")
    for mode in a.modes.split(","):
        with ctx.Pool(1) as pool:  # its own process: the engine's memory goes back with it
            runs[mode] = r = pool.apply(replay, (a, mode))
        print(f"{mode}: {r['output_tokens_per_s']:.1f} out tok/s, TTFT p50 {r['ttft_p50_s']:.3f} "
              f"s p99 {r['ttft_p99_s']:.3f} s, prefix hits {r['prefix_cache_hit_rate']:.2f}, "
              f"tier hits {r.get('offload_hit_tokens', 0)}", flush=True)  # fmt: skip
    ratios = {}
    if "off" in runs and "on" in runs:
        off, on = runs["off"], runs["on"]
        ratios["ttft_p50_on_over_off"] = on["ttft_p50_s"] / off["ttft_p50_s"]
        ratios["throughput_on_over_off"] = on["output_tokens_per_s"] / off["output_tokens_per_s"]
        if "ceiling" in runs:
            ratios["throughput_on_over_ceiling"] = (
                on["output_tokens_per_s"] / runs["ceiling"]["output_tokens_per_s"]
            )
    device = next(iter(runs.values()))["device"].replace(" ", "_")
    out = Path(a.out) / f"kv_offload_{os.path.basename(a.model.rstrip('/'))}_{device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(a), "ratios": ratios, "runs": runs}, indent=1))
    print(json.dumps(ratios, indent=1))
    print("wrote", out)


if __name__ == "__main__":
    main()
