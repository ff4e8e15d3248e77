"""A mixed load through one engine and through a prefill/decode pair behind ``pagedllm proxy``:
long prompts beside chat, at rising request rates; TTFT and TPOT p99 of each class.

Long requests (``--long-in`` random token ids, ``--long-out`` answered) and chat requests
(``--chat-in``, ``--chat-out``) arrive as two Poisson processes; at each rate of ``--rates``
(chat requests/s; the long ones at ``--long-share`` of it) ``--duration`` seconds of arrivals
are sent, streamed, and timed as ``pagedllm bench serving`` times them (TTFT: send to the first
text; TPOT: the rest of the latency over the other tokens). The servers (``pagedllm serve``
with ``--server-args``): ``colocated`` one engine; ``pd`` a ``kv_producer`` and a
``kv_consumer`` sharing a transfer directory, behind ``pagedllm proxy``. On a CPU,
``--pd-threads`` splits the cores between the two (each engine's ``--cpu-threads``). On two
GPUs, ``--gpus P,C``: the colocated engine on GPU P; the producer on P and the consumer on C,
each seeing both (``CUDA_VISIBLE_DEVICES`` P,C and C,P: the consumer opens the producer's
buffer by CUDA IPC).

    python benchmarks/pd_mixed.py --device cpu            # the default model, on this CPU
    python benchmarks/pd_mixed.py --device cuda --gpus 0,1 --model-name qwen3-0.6b \
        --server-args "qwen3-0.6b --load-format dummy --max-model-len 8192" \
        --long-in 4000 --long-out 100 --chat-in 200 --chat-out 400 --rates 2,4,8,16

Writes ``pd_mixed_<model>_<device>.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pagedllm.utils.net import free_port  # noqa: E402


@contextlib.contextmanager
def _process(cmd: list[str], url: str, log: Path, gpus: str = "") -> Iterator[str]:
    """``cmd`` running until ``url``/health answers 200 (``gpus``: its
    CUDA_VISIBLE_DEVICES); yields ``url``."""
    from pagedllm.utils.child import stop_process, wait_healthy

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            if not wait_healthy(proc, url, 600):
                raise RuntimeError(f"{cmd[3]} did not start:\n{log.read_text()[-2000:]}")
            yield url
        finally:
            stop_process(proc, 20)


def _serve(a: argparse.Namespace, log: Path, *extra: str, gpus: str = "") -> Any:
    port = free_port()
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--port", str(port),
           "--uvicorn-log-level", "warning", "--device", a.device,
           *shlex.split(a.server_args), *extra]  # fmt: skip
    return _process(cmd, f"http://127.0.0.1:{port}", log, gpus)


@contextlib.contextmanager
def servers(a: argparse.Namespace, setup: str, logs: Path) -> Iterator[str]:
    """The base URL clients send to for ``setup`` (colocated | pd)."""
    p_gpu, c_gpu = a.gpus.split(",") if a.gpus else ("", "")
    if setup == "colocated":
        with _serve(a, logs / "colocated.log", *a.colocated_args.split(), gpus=p_gpu) as url:
            yield url
        return
    buf = tempfile.mkdtemp(
        prefix="pd-mixed-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
    )

    def role(r: str) -> list[str]:
        config = {"kv_role": r, "kv_buffer_path": buf, "engine_id": r.split("_")[1]}
        return ["--kv-transfer-config", json.dumps(config), *a.pd_args.split()]

    with contextlib.ExitStack() as stack:
        pc, cp = (f"{p_gpu},{c_gpu}", f"{c_gpu},{p_gpu}") if a.gpus else ("", "")
        p = stack.enter_context(_serve(a, logs / "producer.log", *role("kv_producer"), gpus=pc))
        d = stack.enter_context(_serve(a, logs / "consumer.log", *role("kv_consumer"), gpus=cp))
        port = free_port()
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "proxy", "--prefill", p,
               "--decode", d, "--port", str(port)]  # fmt: skip
        yield stack.enter_context(_process(cmd, f"http://127.0.0.1:{port}", logs / "proxy.log"))


async def load(a: argparse.Namespace, base: str, rate: float, seed: int) -> dict[str, Any]:
    """One rate's arrivals through ``base``; per class: TTFT and TPOT p50/p99, errors."""
    import httpx

    from pagedllm.bench.serving import _one

    rng = np.random.default_rng(seed)
    kinds = {
        "long": (a.long_in, a.long_out, rate * a.long_share),
        "chat": (a.chat_in, a.chat_out, rate),
    }
    plan: list[tuple[float, str, list[int], int]] = []
    for kind, (n_in, n_out, r) in kinds.items():
        t = rng.exponential(1 / r)
        while t < a.duration:
            plan.append((t, kind, rng.integers(100, 20000, size=n_in).tolist(), n_out))
            t += rng.exponential(1 / r)
    plan.sort(key=lambda x: x[0])
    args = argparse.Namespace(endpoint="completions", model=a.model_name)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base + "/v1", timeout=httpx.Timeout(None),
                                 limits=limits) as client:  # fmt: skip
        t0 = time.perf_counter()

        async def send(at: float, prompt: list[int], n_out: int) -> Any:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            return await _one(client, args, prompt, n_out, t0)

        results = await asyncio.gather(*(send(t, p, n) for t, _, p, n in plan))
    out: dict[str, Any] = {"rate": rate}
    for kind in kinds:
        rs = [r for (_, k, _, _), r in zip(plan, results) if k == kind]
        ok = [r for r in rs if r.error is None]
        ttft = [r.ttft for r in ok]
        tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
        out[kind] = {
            "requests": len(rs),
            "errors": len(rs) - len(ok),
            "ttft_p50_s": float(np.percentile(ttft, 50)) if ttft else None,
            "ttft_p99_s": float(np.percentile(ttft, 99)) if ttft else None,
            "tpot_p50_s": float(np.percentile(tpot, 50)) if tpot else None,
            "tpot_p99_s": float(np.percentile(tpot, 99)) if tpot else None,
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--server-args", default="--max-model-len 2048",
                    help="every engine's serve arguments (no model: the default one)")  # fmt: skip
    ap.add_argument("--colocated-args", default="", help="the colocated engine's, beside those")
    ap.add_argument("--pd-args", default="", help="each engine of the pair's, beside those")
    ap.add_argument("--model-name", default="SmolLM2-135M-Instruct")
    ap.add_argument("--rates", default="0.5,1,2", help="chat requests/s")
    ap.add_argument("--long-share", type=float, default=0.25)
    ap.add_argument("--long-in", type=int, default=1500)
    ap.add_argument("--long-out", type=int, default=32)
    ap.add_argument("--chat-in", type=int, default=200)
    ap.add_argument("--chat-out", type=int, default=100)
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals a rate")
    ap.add_argument("--setups", default="colocated,pd")
    ap.add_argument("--gpus", default="", help="P,C: the producer's and consumer's GPUs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = ap.parse_args()
    if a.gpus and (a.device != "cuda" or len(set(a.gpus.split(","))) != 2):
        raise SystemExit(f"--gpus: two different GPUs as P,C with --device cuda, got {a.gpus!r}")
    from benchmarks.kv_offload import _device_name

    logs = Path(tempfile.mkdtemp(prefix="pd-mixed-logs-"))
    runs: dict[str, list[dict]] = {}
    for setup in a.setups.split(","):
        with servers(a, setup, logs) as base:
            asyncio.run(load(a, base, float(a.rates.split(",")[0]), a.seed + 99))  # warm-up
            runs[setup] = []
            for i, rate in enumerate(float(r) for r in a.rates.split(",")):
                r = asyncio.run(load(a, base, rate, a.seed + i))
                runs[setup].append(r)
                print(setup, json.dumps(r), flush=True)
    device = _device_name(a.device) + ("_x2" if a.gpus else "")
    out = Path(a.out) / f"pd_mixed_{a.model_name}_{device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(a), "device": device, "runs": runs}, indent=1))
    print("wrote", out)


if __name__ == "__main__":
    main()
