"""Host time of ``CUDAGraph.replay()`` for a graph of many small kernels (a decode step's
shape): with the GPU idle, while another graph's replay is still queued, and while the SAME
graph's previous replay is (does the launch wait for it?). One GPU.

    python benchmarks/graph_launch_micro.py [--nodes 600] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def _graph(nodes: int, x: torch.Tensor) -> torch.cuda.CUDAGraph:
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(nodes):
            x.add_(1)
    return g


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=600)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    x = torch.zeros(4096, device="cuda")
    y = torch.zeros(4096, device="cuda")
    ga, gb = _graph(args.nodes, x), _graph(args.nodes, y)
    for g in (ga, gb):
        g.replay()
    torch.cuda.synchronize()

    def launch_us(before: list, g: torch.cuda.CUDAGraph) -> float:
        times = []
        for _ in range(args.reps):
            torch.cuda.synchronize()
            torch.cuda._sleep(5_000_000)  # keep the GPU busy a few ms
            for b in before:
                b.replay()
            t = time.perf_counter()
            g.replay()
            times.append((time.perf_counter() - t) * 1e6)
        torch.cuda.synchronize()
        return statistics.median(times)

    def idle_us(g: torch.cuda.CUDAGraph) -> float:
        times = []
        for _ in range(args.reps):
            torch.cuda.synchronize()
            t = time.perf_counter()
            g.replay()
            times.append((time.perf_counter() - t) * 1e6)
        torch.cuda.synchronize()
        return statistics.median(times)

    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    ga.replay()
    end.record()
    torch.cuda.synchronize()
    res = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "nodes": args.nodes,
        "graph_device_us": start.elapsed_time(end) * 1e3,
        "launch_us_gpu_idle": idle_us(ga),
        "launch_us_behind_busy_gpu": launch_us([], ga),
        "launch_us_behind_other_graph": launch_us([gb], ga),
        "launch_us_behind_same_graph": launch_us([ga], ga),
        "git_commit": os.environ.get("PAGEDLLM_COMMIT"),
    }
    print(json.dumps(res, indent=1))
    if args.out:
        path = os.path.join(args.out, f"graph_launch_{res['device'].replace(' ', '_')}.json")
        with open(path, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
