"""The serving load generator's own ceiling: ``pagedllm bench serving`` against the canned server.

One canned server (``pagedllm.bench.canned_server``: no model, one SSE chunk per token as fast as
it can) on a loopback port, then ``serving.run_benchmark`` once per (concurrency, client, client
processes), every run on the same prompts. Reports streamed chunks/s and output tokens/s per run
(the canned server sends one token per chunk, so the two are equal) and the client's CPU time per
chunk, and writes a JSON and a bar chart. ``--canned-step-ms`` paces the server (one chunk per
stream per tick), so that reads carry about one event each, as from a real server. The server
shares the machine's cores with the client: on a small machine the numbers are the pair's
ceiling, a lower bound on the client's own.

    .venv/bin/python benchmarks/serving_client_ceiling.py --concurrency 64 256 \\
        --clients httpx raw --client-processes 1 2 --output-len 256
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from typing import Any

from pagedllm.bench import _http_client, canned_server, serving


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    p.add_argument("--clients", nargs="+", choices=["raw", "httpx"], default=["httpx", "raw"])
    p.add_argument("--client-processes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--num-prompts", type=int, default=1024)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--canned-processes", type=int, default=1)
    p.add_argument(
        "--canned-step-ms",
        type=float,
        default=0.0,
        help="wait between the canned server's token ticks (0: as fast as it can)",
    )
    p.add_argument(
        "--loop",
        choices=["auto", "asyncio", "uvloop"],
        default="auto",
        help="event loop of the client and the canned server (auto: uvloop if installed)",
    )
    p.add_argument("--out", default="benchmarks/results/serving_client_ceiling")
    p.add_argument("--no-plot", action="store_true")
    return p.parse_args(argv)


def one_run(args: argparse.Namespace, url: str, result_dir: str, conc: int, client: str,
            procs: int) -> dict[str, Any]:  # fmt: skip
    """One ``pagedllm bench serving`` run against ``url``; its row of the result."""
    parser = argparse.ArgumentParser()
    serving.add_arguments(parser)
    sargs = parser.parse_args([
        "--base-url", url, "--endpoint", args.endpoint, "--client", client,
        "--client-processes", str(procs), "--num-prompts", str(args.num_prompts),
        "--input-len", str(args.input_len), "--output-len", str(args.output_len),
        "--concurrency", str(conc), "--result-dir", result_dir, "--no-plot", "--loop", args.loop,
    ])  # fmt: skip
    t = time.perf_counter()
    s = serving.run_benchmark(sargs)["server"]
    return {
        "concurrency": conc, "client": client, "client_processes": procs,
        "num_prompts": args.num_prompts, "completed": s["completed"],
        "elapsed_s": s["elapsed_s"], "chunk_throughput": s["chunk_throughput"],
        "output_throughput": s["output_throughput"],
        "ttft_p50_ms": s["ttft_ms"]["p50"], "itl_p50_ms": s["itl_ms"]["p50"],
        "client_cpu_s": s["client_cpu_s"],
        "client_cpu_us_per_chunk": 1e6 * s["client_cpu_s"] / max(1, s["total_chunks"]),
        "wall_s": time.perf_counter() - t,
    }  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every run of the grid against one canned server; returns the result dict."""
    rows = []
    canned = canned_server.spawned(
        args.canned_processes, step_ms=args.canned_step_ms, loop=args.loop
    )
    with canned as url, tempfile.TemporaryDirectory() as tmp:
        for conc in args.concurrency:
            for procs in args.client_processes:
                for client in args.clients:
                    row = one_run(args, url, tmp, conc, client, procs)
                    rows.append(row)
                    print(f"c{conc:<4} {client:5} x{procs}: {row['chunk_throughput']:9,.0f} "
                          f"chunks/s, client CPU {row['client_cpu_us_per_chunk']:.1f} us/chunk "
                          f"({row['completed']}/{row['num_prompts']} ok, "
                          f"{row['elapsed_s']:.2f} s)", flush=True)  # fmt: skip
    return {
        "benchmark": "serving_client_ceiling",
        "cpu_count": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "workload": {
            k: getattr(args, k)
            for k in (
                "endpoint",
                "num_prompts",
                "input_len",
                "output_len",
                "canned_processes",
                "canned_step_ms",
            )
        },  # fmt: skip
        "loop": _http_client.loop_name(args.loop),
        "runs": rows,
    }


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["runs"]
    labels = [f"c{r['concurrency']}\n{r['client']} x{r['client_processes']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(rows)), 4))
    ax.bar(labels, [r["chunk_throughput"] for r in rows])
    ax.set_ylabel("streamed chunks/s")
    w = result["workload"]
    ax.set_title(f"load generator vs canned server ({result['cpu_count']} CPUs, "
                 f"{w['output_len']} tokens/request)")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=2)
    if not args.no_plot:
        plot(result, args.out + ".png")
    print(f"wrote {args.out}.json" + ("" if args.no_plot else f" {args.out}.png"))
    return int(any(r["completed"] != r["num_prompts"] for r in result["runs"]))


if __name__ == "__main__":
    sys.exit(main())
