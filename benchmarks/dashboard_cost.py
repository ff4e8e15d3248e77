"""What watching the dashboard costs the engine, in one run per device.

CPU (default): ``pagedllm serve`` on the packaged SmolLM2-135M-Instruct, driven by ``pagedllm
bench serving`` (random words, 128 in, 64 out, greedy, concurrency 8), alternately with no
dashboard open and with one viewer on ``/dashboard/events?hz=4`` (the most the server sends: a
snapshot built by the engine core every 0.25 s), ``--pairs`` pairs, closed first in each pair;
output tok/s of each, their medians and the ratio. Two servers: the paged KV cache and
``--enable-kvc --compression-rate 4`` (a one-head block per (layer, KV head): the largest map).
The viewer is a separate process (a browser is elsewhere); it also records each snapshot's
``build_ms`` and size.

GPU (``--gpu``): Benchmark A's workload (``pagedllm bench throughput``, Qwen3-0.6B shape,
random weights, bf16, 256 prompts 100-1024 in, 1-1024 out) offline, alternately as is and with
a frame of the dashboard's snapshot taken between steps every 0.25 s (``--kv-map-report``: the
core-side work of a viewer at 4 Hz), ``--pairs`` pairs. The issue's bound: <= 1% difference.

    .venv/bin/python -P benchmarks/dashboard_cost.py            # CPU, both servers
    python -P benchmarks/dashboard_cost.py --gpu --out DIR      # (gpu_run.sh dashboard-a)

Writes ``dashboard_cost_<device>.json`` to ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._live_server import LiveServer  # noqa: E402

VIEWER = r"""
import json, sys, time, httpx
url, seconds, out = sys.argv[1], float(sys.argv[2]), sys.argv[3]
events, build, size = 0, [], []
t0 = time.monotonic()
with httpx.stream("GET", url + "/dashboard/events?hz=4", timeout=30) as r:
    for line in r.iter_lines():
        if line.startswith("data: "):
            events += 1
            size.append(len(line))
            build.append(json.loads(line[6:])["snapshot"]["build_ms"])
        if time.monotonic() - t0 > seconds:
            break
json.dump({"events": events, "seconds": time.monotonic() - t0, "build_ms": build,
           "bytes": size}, open(out, "w"))
"""


def _load(url: str, model: str, prompts: int, work: str) -> dict[str, Any]:
    """One timed ``pagedllm bench serving`` run against ``url``; its summary."""
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", "serving",
           "--base-url", url + "/v1", "--model", model, "--num-prompts", str(prompts),
           "--concurrency", "8", "--input-len", "128", "--output-len", "64", "--warmup", "2",
           "--no-plot", "--result-dir", work, "--result-name", "run"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, cwd=ROOT)
    with open(os.path.join(work, "run.json")) as f:
        result = json.load(f)["server"]
    assert result["failed"] == 0, result
    return {"output_tokens_per_s": result["output_throughput"],
            "tpot_ms_p50": result["tpot_ms"]["p50"]}  # fmt: skip


def _pctl(xs: list[float], q: float) -> float | None:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def cpu_server(name: str, extra: tuple[str, ...], pairs: int, prompts: int) -> dict[str, Any]:
    work = tempfile.mkdtemp(prefix=f"dash_{name}_")
    srv = LiveServer(server_args=["--max-model-len", "1024", *extra])
    try:
        model = srv.model_name()
        _load(srv.url, model, 16, work)  # warm-up
        closed, opened, viewers = [], [], []
        for _ in range(pairs):
            closed.append(_load(srv.url, model, prompts, work))
            out = os.path.join(work, "viewer.json")
            viewer = subprocess.Popen([sys.executable, "-c", VIEWER, srv.url, "3600", out])
            time.sleep(1.0)  # connected and receiving before the load starts
            t0 = time.monotonic()
            opened.append(_load(srv.url, model, prompts, work))
            viewer.terminate()
            viewer.wait()
            seen = json.loads(srv.get("/dashboard/state")[1])["version"]
            viewers.append({"seconds": time.monotonic() - t0, "snapshots_so_far": seen})
        snap = json.loads(srv.get("/dashboard/state")[1])
    finally:
        srv.stop()
    # the viewer killed mid-stream wrote nothing: read the build times from one more short run
    builds = _viewer_sample(extra)
    med = {k: statistics.median(r["output_tokens_per_s"] for r in runs)
           for k, runs in (("closed", closed), ("open", opened))}  # fmt: skip
    return {
        "server_args": list(extra),
        "blocks": snap["snapshot"]["blocks"]["total"],
        "per_head": snap["snapshot"]["blocks"]["per_head"],
        "closed": closed, "open": opened, "viewers": viewers,
        "median_output_tokens_per_s": med,
        "ratio_open_to_closed": med["open"] / med["closed"],
        "snapshot": builds,
    }  # fmt: skip


def _viewer_sample(extra: tuple[str, ...]) -> dict[str, Any]:
    """Build times and sizes of the snapshots a 4 Hz viewer gets while requests run (a short
    load of its own), and the core time they take per second."""
    work = tempfile.mkdtemp(prefix="dash_sample_")
    srv = LiveServer(server_args=["--max-model-len", "1024", *extra])
    try:
        model = srv.model_name()
        out = os.path.join(work, "viewer.json")
        viewer = subprocess.Popen([sys.executable, "-c", VIEWER, srv.url, "20", out])
        _load(srv.url, model, 32, work)
        viewer.wait(timeout=120)
        with open(out) as f:
            v = json.load(f)
    finally:
        srv.stop()
    b = v["build_ms"]
    return {"events": v["events"], "events_per_s": v["events"] / v["seconds"],
            "build_ms_p50": _pctl(b, 0.5), "build_ms_p99": _pctl(b, 0.99),
            "bytes_p50": _pctl(v["bytes"], 0.5),
            "core_time_fraction_at_4hz": 4 * (_pctl(b, 0.5) or 0) / 1e3}  # fmt: skip


def gpu(pairs: int) -> dict[str, Any]:
    """Benchmark A offline, with and without a snapshot every 0.25 s between steps."""
    import torch

    work = tempfile.mkdtemp(prefix="dash_gpu_")
    base = [sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", "throughput",
            "--model", "qwen3-0.6b", "--load-format", "dummy", "--dtype", "bfloat16",
            "--num-prompts", "256", "--input-len", "562", "--output-len", "512",
            "--range-ratio", str(462 / 562), "--max-model-len", "2048"]  # fmt: skip
    runs: dict[str, list] = {"closed": [], "open": []}
    for i in range(pairs):
        for mode in ("closed", "open"):
            out = os.path.join(work, f"{mode}{i}.json")
            cmd = base + ["--output-json", out]
            if mode == "open":
                cmd += ["--kv-map-report", os.path.join(work, "r.html"), "--kv-map-every", "0.25"]
            subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
            with open(out) as f:
                r = json.load(f)
            roof = r["roofline"] or {}
            runs[mode].append({"output_tokens_per_s": r["output_tokens_per_s"],
                               "roofline_fraction": roof.get("achieved_fraction")})  # fmt: skip
    med = {k: statistics.median(x["output_tokens_per_s"] for x in v) for k, v in runs.items()}
    return {
        "device": torch.cuda.get_device_name(),
        "runs": runs,
        "median_output_tokens_per_s": med,
        "ratio_open_to_closed": med["open"] / med["closed"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpu", action="store_true", help="Benchmark A offline on the GPU.")
    p.add_argument("--pairs", type=int, default=3, help="(closed, open) pairs per server.")
    p.add_argument("--prompts", type=int, default=64, help="CPU: prompts per timed run.")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args()
    import platform

    if args.gpu:
        result = {"benchmark": "dashboard cost, Benchmark A offline", **gpu(args.pairs)}
        device = result["device"]
    else:
        device = "cpu"
        result = {"benchmark": "dashboard cost, CPU serving", "device": platform.processor()
                  or platform.machine(), "cores": os.cpu_count(),
                  "workload": "SmolLM2-135M-Instruct GGUF, 128 in / 64 out, concurrency 8, "
                              f"{args.prompts} prompts per run",
                  "paged": cpu_server("paged", (), args.pairs, args.prompts),
                  "kvc": cpu_server("kvc", ("--enable-kvc", "--compression-rate", "4"),
                                    args.pairs, args.prompts)}  # fmt: skip
    result["commit"] = (
        os.environ.get("PAGEDLLM_COMMIT")
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
        ).stdout.strip()
    )
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"dashboard_cost_{device.replace(' ', '_')}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1)[:3000])
    print("wrote", path)


if __name__ == "__main__":
    main()
