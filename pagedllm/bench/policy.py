"""``pagedllm bench policy``: a Poisson stream of short and long requests under fcfs and sjf
(see ``pagedllm.bench.scenarios``): latency of the short ones, worst latency of the long ones.
Writes JSON + PNG under ``--out`` and prints the JSON's path."""

from __future__ import annotations

import argparse

from pagedllm.bench import scenarios


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The workload's flags (shared with ``pagedllm bench prefix``)."""
    scenarios.add_arguments(parser)


def main(args: argparse.Namespace) -> int:
    """Replay the stream under each policy; write the result; 0 on success."""
    result = scenarios.run_policy(args)
    path = scenarios.write(result, args, "policy")
    for policy in ("fcfs", "sjf"):
        short, long = result[policy]["short"], result[policy]["long"]
        nan = float("nan")
        print(
            f"{policy}: short mean {short.get('latency_mean_s', nan):.3f} s, "
            f"p99 {short.get('latency_p99_s', nan):.3f} s; "
            f"long max {long.get('latency_max_s', nan):.3f} s"
        )
    print(path)
    return 0
