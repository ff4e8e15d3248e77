"""``pagedllm bench prefix``: prefix caching on vs off, on N requests sharing one long prefix
and on a multi-turn chat replay (see ``pagedllm.bench.scenarios``). Writes JSON + PNG under
``--out`` and prints the JSON's path."""

from __future__ import annotations

import argparse

from pagedllm.bench import scenarios


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The workload's flags (shared with ``pagedllm bench policy``)."""
    scenarios.add_arguments(parser)


def main(args: argparse.Namespace) -> int:
    """Run both workloads with caching on and off; write the result; 0 on success."""
    result = scenarios.run_prefix(args)
    path = scenarios.write(result, args, "prefix")
    for name in ("shared_prefix", "chat_replay"):
        r = result[name]
        print(
            f"{name}: throughput x{r['throughput_ratio']:.2f} with caching, "
            f"hit rate {r['caching_on']['hit_rate']:.1%}"
        )
    print(path)
    return 0
