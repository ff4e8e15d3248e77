"""Prefill/decode disaggregation on one device: what handing a prompt's KV from a producer
engine to a consumer engine costs (``kv_transfer_config``, the shared-memory transport), next
to one engine computing everything, and to the machine's copy rates.

One process per phase, each with the device (the transfer files wait in ``--buffer``
between them):

- ``colocated``: one engine runs the ``--num-prompts`` prompts (``--input-len`` random token
  ids) to ``--output-len`` tokens: the time until every prompt has its first token (the
  prefill) and the total; the reference tokens.
- ``producer``: the prompts with one output token and ``do_remote_decode``: prefill plus the
  writes. Transport ``file`` (``kv_buffer_size`` 0): gathered on the device, copied to pinned
  memory, written to the files; the process ends before the consumer starts. Transport
  ``buffer``: gathered into the producer's device buffer (``--buffer-gib``); the process
  stays until the consumer is done (the buffer is its memory).
- ``consumer``: the prompts with the producer's ``kv_transfer_params``: the loads (files to
  pinned memory to the device; or the producer's buffer, opened by CUDA IPC, device to
  device) plus each prompt's last partial block, then the decode; its greedy tokens must be
  the colocated ones.

Copy rates are device time for the buffer (CUDA events around the copies) and host time
for files (the reads and writes, which the steps wait for).

``--gpus P,C`` (two GPUs of one host): the colocated run and the producer on GPU P, the
consumer on GPU C, which also sees P (``CUDA_VISIBLE_DEVICES=C,P``: CUDA IPC opens only a
visible GPU's memory); the buffer's rows then cross between the GPUs (NVLink or PCIe peer to
peer) and the reference rate is a peer copy, P to C.

The copy rates of the same machine, for scale: pinned host to device, device to pinned host,
device to device, and a write and a read of a shared-memory file (``numpy.memmap``).

    python benchmarks/pd_transfer.py --model qwen3-0.6b --load-format dummy --device cuda
    python benchmarks/pd_transfer.py --model qwen3-0.6b --load-format dummy --gpus 0,1
    python benchmarks/pd_transfer.py --model TINY_DIR --num-prompts 4 --input-len 500 \\
        --output-len 8 --device cpu                                    # a CPU smoke run

Writes ``pd_transfer_<model>_<device>.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ROLES = {"producer": "kv_producer", "consumer": "kv_consumer"}


def phase(a: argparse.Namespace, name: str, params: list[dict] | None,
          transport: str = "file") -> dict:  # fmt: skip
    """One phase in this process (see the module docstring)."""
    if a.gpus:  # (before CUDA starts in this process)
        p, c = a.gpus.split(",")
        os.environ["CUDA_VISIBLE_DEVICES"] = f"{c},{p}" if name == "consumer" else f"{p},{c}"
    from benchmarks.kv_offload import _device_name
    from pagedllm import SamplingParams
    from pagedllm.config import EngineArgs
    from pagedllm.engine.llm_engine import LLMEngine

    kw: dict[str, Any] = {}
    if name in ROLES:
        size = int(a.buffer_gib * 2**30) if transport == "buffer" else 0
        kw["kv_transfer_config"] = {
            "kv_role": ROLES[name], "kv_buffer_path": a.buffer, "engine_id": f"bench-{transport}",
            "kv_transfer_timeout": 3600, "kv_buffer_size": size,
        }  # fmt: skip
    args = EngineArgs(
        model=a.model, load_format=a.load_format, dtype=a.dtype, device=a.device, seed=0,
        max_model_len=a.input_len + a.output_len + 16, max_num_seqs=a.num_prompts,
        kv_cache_memory_bytes=int(a.kv_cache_gib * 2**30), enable_prefix_caching=False, **kw,
    )  # fmt: skip
    engine = LLMEngine.from_engine_args(args)
    rng = np.random.default_rng(a.seed)
    vocab = engine.input_processor.vocab_size
    prompts = [rng.integers(10, min(vocab, 30000), size=a.input_len).tolist()
               for _ in range(a.num_prompts)]  # fmt: skip
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request("warm", {"prompt_token_ids": prompts[0][:64]}, warm)
    while engine.has_unfinished_requests():
        engine.step()
    n_out = 1 if name == "producer" else a.output_len
    for i, p in enumerate(prompts):
        extra = None
        if name == "producer":
            extra = {"kv_transfer_params": {"do_remote_decode": True}}
        elif name == "consumer":
            extra = {"kv_transfer_params": params[i]}
        sp = SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True, extra_args=extra)
        engine.add_request(str(i), {"prompt_token_ids": p}, sp, output_kind="delta")
    t0 = time.perf_counter()
    first: dict[str, float] = {}
    outs: dict[str, Any] = {}
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.outputs[0].token_ids and o.request_id not in first:
                first[o.request_id] = time.perf_counter() - t0
            tokens.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
            if o.finished:
                outs[o.request_id] = o
    total = time.perf_counter() - t0
    stats = engine.engine_core.stats()
    result = {
        "phase": name,
        "device": _device_name(a.device),
        "all_first_tokens_s": max(first.values()),
        "total_s": total,
        "tokens": [tokens[str(i)] for i in range(a.num_prompts)],
        "kv_transfer_params": [outs[str(i)].kv_transfer_params for i in range(a.num_prompts)],
        **{k: v for k, v in stats.items() if k.startswith("kv_transfer_")},
    }
    if name == "consumer":
        result["copy_rates_gb_s"] = copy_rates(a.device, a.buffer, peer=bool(a.gpus))
    return result


def _producer_stays(a: argparse.Namespace, conn: Any) -> None:
    """The buffer transport's producer: its phase, the result sent, then alive until told."""
    conn.send(phase(a, "producer", None, "buffer"))
    conn.recv()


def copy_rates(
    device: str, directory: str, nbytes: int = 256 << 20, peer: bool = False
) -> dict[str, float]:
    """GB/s of the copies a transfer is made of, on this machine (``peer``: also from the
    second visible GPU to the first, the producer's to the consumer's)."""
    import torch

    def rate(fn: Any, sync: Any) -> float:
        fn()
        sync()
        t0 = time.perf_counter()
        for _ in range(5):
            fn()
        sync()
        return 5 * nbytes / (time.perf_counter() - t0) / 1e9

    rates: dict[str, float] = {}
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    other = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    if cuda:
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dev2 = torch.empty_like(dev)
        rates["host_to_device"] = rate(lambda: dev.copy_(host, non_blocking=True), sync)
        rates["device_to_host"] = rate(lambda: host.copy_(dev, non_blocking=True), sync)
        rates["device_to_device"] = rate(lambda: dev2.copy_(dev), sync)
        if peer:
            far = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
            rates["peer_to_device"] = rate(lambda: dev.copy_(far), sync)
    else:
        rates["host_to_host"] = rate(lambda: other.copy_(host), sync)
    path = os.path.join(directory, "rate.bin")
    file = np.memmap(path, np.uint8, "w+", shape=(nbytes,))
    src, dst = host.numpy(), other.numpy()
    rates["file_write"] = rate(lambda: np.copyto(file, src), sync)
    rates["file_read"] = rate(lambda: np.copyto(dst, file), sync)
    os.unlink(path)
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=4000)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--kv-cache-gib", type=float, default=12.0, help="each engine's KV cache")
    ap.add_argument("--buffer", default="", help="transfer directory (default: a new one)")
    ap.add_argument(
        "--transports",
        default="file,buffer",
        help="file (through host memory), buffer (the producer's device buffer)",
    )
    ap.add_argument(
        "--buffer-gib",
        type=float,
        default=10.0,
        help="the producer's kv_buffer_size for the buffer transport",
    )
    ap.add_argument("--gpus", default="", help="P,C: producer and consumer GPUs (two GPUs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = ap.parse_args()
    if a.gpus and (a.device != "cuda" or len(set(a.gpus.split(","))) != 2):
        raise SystemExit(f"--gpus: two different GPUs as P,C with --device cuda, got {a.gpus!r}")
    made = not a.buffer
    if made:
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        a.buffer = tempfile.mkdtemp(prefix="pd-bench-", dir=base)
    transports = a.transports.split(",")
    if not set(transports) <= {"file", "buffer"}:
        raise SystemExit(f"--transports: file and/or buffer, got {a.transports!r}")
    runs: dict[str, dict] = {}
    ctx = multiprocessing.get_context("spawn")

    def show(name: str, r: dict) -> None:
        print(f"{name}: first tokens {r['all_first_tokens_s']:.3f} s, total "
              f"{r['total_s']:.3f} s", flush=True)  # fmt: skip

    try:
        with ctx.Pool(1) as pool:  # its own process: the engine's memory goes back with it
            runs["colocated"] = pool.apply(phase, (a, "colocated", None))
        show("colocated", runs["colocated"])
        for t in transports:
            stay = None
            if t == "file":
                with ctx.Pool(1) as pool:
                    prod = pool.apply(phase, (a, "producer", None, t))
            else:
                here, there = ctx.Pipe()
                stay = ctx.Process(target=_producer_stays, args=(a, there))
                stay.start()
                prod = here.recv()
            show(f"producer ({t})", prod)
            try:
                with ctx.Pool(1) as pool:
                    cons = pool.apply(phase, (a, "consumer", prod["kv_transfer_params"], t))
            finally:
                if stay is not None:
                    here.send("done")
                    stay.join(120)
            show(f"consumer ({t})", cons)
            runs[f"producer_{t}"], runs[f"consumer_{t}"] = prod, cons
    finally:
        if made:
            shutil.rmtree(a.buffer, ignore_errors=True)
    col = runs["colocated"]
    results: dict[str, Any] = {}
    for t in transports:
        results[t] = {
            "summary": _summary(a, t, col, runs[f"producer_{t}"], runs[f"consumer_{t}"]),
            "runs": {"producer": runs[f"producer_{t}"], "consumer": runs[f"consumer_{t}"]},
        }
    for r in runs.values():
        r.pop("tokens")
        r.pop("kv_transfer_params")
    device = col["device"].replace(" ", "_") + ("_x2" if a.gpus else "")
    out = Path(a.out) / f"pd_transfer_{os.path.basename(a.model.rstrip('/'))}_{device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    args = {k: v for k, v in vars(a).items() if k != "buffer"}
    out.write_text(json.dumps({"args": args, "colocated": col, **results}, indent=1))
    print(json.dumps({t: r["summary"] for t, r in results.items()}, indent=1))
    print("wrote", out)


def _summary(a: argparse.Namespace, transport: str, col: dict, prod: dict, cons: dict) -> dict:
    """One transport's ratios to the colocated run and to the machine's copy rates."""
    rates = cons["copy_rates_gb_s"]
    same = [
        next((j for j, (x, y) in enumerate(zip(c, r)) if x != y), len(r))
        for c, r in zip(cons["tokens"], col["tokens"])
    ]  # tokens each consumer request shares with the colocated one before they differ
    summary = {
        "tokens_equal": cons["tokens"] == col["tokens"],
        "requests_equal": sum(n == a.output_len for n in same),
        "mean_tokens_before_a_difference": float(np.mean(same)),
        "transferred_tokens": cons.get("kv_transfer_received_tokens", 0),
        "buffered_transfers": prod.get("kv_transfer_buffered", 0),
        "save_gb_s": prod["kv_transfer_bytes"] / max(prod["kv_transfer_save_s"], 1e-9) / 1e9,
        "load_gb_s": cons["kv_transfer_bytes"] / max(cons["kv_transfer_load_s"], 1e-9) / 1e9,
        "producer_over_colocated_prefill": prod["total_s"] / col["all_first_tokens_s"],
        "consumer_first_tokens_over_colocated": (
            cons["all_first_tokens_s"] / col["all_first_tokens_s"]
        ),
        "consumer_total_over_colocated": cons["total_s"] / col["total_s"],
    }
    if transport == "buffer" and "device_to_device" in rates:
        for k in ("save", "load"):
            summary[f"{k}_over_device_copy"] = summary[f"{k}_gb_s"] / rates["device_to_device"]
        if "peer_to_device" in rates:  # (the load crosses between the GPUs)
            summary["load_over_peer_copy"] = summary["load_gb_s"] / rates["peer_to_device"]
        return summary
    slow = ("device_to_host", "file_write") if "device_to_host" in rates else ("file_write",)
    summary["save_over_slowest_copy"] = summary["save_gb_s"] / min(rates[k] for k in slow)
    slow = ("host_to_device", "file_read") if "host_to_device" in rates else ("file_read",)
    summary["load_over_slowest_copy"] = summary["load_gb_s"] / min(rates[k] for k in slow)
    return summary


if __name__ == "__main__":
    main()
