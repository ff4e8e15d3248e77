"""The engine core's host work per step, with no model: the scheduler's ``schedule`` and
``update_from_output`` and the plan's pickling (what the multiprocess executor sends), on
Benchmark B's request shape (prompt 128, output ``--out-len``, greedy, ``ignore_eos``) with
``--max-seqs`` running, pipelined as async scheduling runs them (step N is scheduled before
step N-1's tokens come back). Under tensor parallelism these sit on the chain from one
step's tokens to the next step's launch (see benchmarks/README.md), so they bound the step
time when the device is fast.

    python benchmarks/host_sched_micro.py [--num 1000 --max-seqs 256 --out-len 256]
"""

from __future__ import annotations

import argparse
import gc
import pickle
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedllm.config import CacheConfig, KVCompressConfig, SchedulerConfig  # noqa: E402
from pagedllm.core.kv_cache.spec import HeadPagedSpec, KVCacheGroup, KVCacheGroups  # noqa: E402
from pagedllm.core.request import Request  # noqa: E402
from pagedllm.core.sched.output import ModelRunnerOutput  # noqa: E402
from pagedllm.core.sched.scheduler import Scheduler  # noqa: E402
from pagedllm.sampling_params import SamplingParams  # noqa: E402


def run(args: argparse.Namespace) -> dict[str, float]:
    groups, kvc, blocks = None, None, args.blocks
    if args.kvc:
        # KV-Compress without a budget, Qwen3-0.6B's shape (Benchmark A: 28 layers x 8 KV
        # heads): one block per (layer, head), so 224x the block ids of the same token count
        layers, heads = 28, 8
        spec = HeadPagedSpec(16, heads, 128, 2, num_layers=layers, compressible=(True,) * layers)
        groups = KVCacheGroups((KVCacheGroup(spec, tuple(range(layers))),), 1, (spec,))
        kvc, blocks = KVCompressConfig(enabled=True), args.blocks * layers * heads
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=args.max_seqs,
                        max_model_len=4096, enable_chunked_prefill=True),
        CacheConfig(block_size=16, enable_prefix_caching=args.prefix_caching),
        blocks, 0, kv_groups=groups, kvc_config=kvc,
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=args.out_len, ignore_eos=True)
    for i in range(args.num):
        start = 1 + i * 1000
        sched.add_request(Request(str(i), list(range(start, start + 128)), params,
                                  eos_token_id=2, arrival_time=float(i)))  # fmt: skip
    times = {"schedule": 0.0, "update": 0.0, "pickle": 0.0}
    steps = 0
    pending = None
    gc.freeze()
    clock = time.perf_counter
    while sched.has_unfinished_requests() or pending is not None:
        t0 = clock()
        so = sched.schedule() if sched.has_unfinished_requests() else None
        t1 = clock()
        if so is not None:
            pickle.dumps(so, protocol=pickle.HIGHEST_PROTOCOL)
        t2 = clock()
        if pending is not None:
            last = pending
            ids = list(last.num_scheduled_tokens)
            reqs = sched.requests  # (one that finished in step N - 1 is gone: N drops it)
            toks = [[7] if r in reqs and reqs[r].num_output_placeholders else [] for r in ids]
            sched.update_from_output(last, ModelRunnerOutput(req_ids=ids, sampled_token_ids=toks))
        t3 = clock()
        pending = so
        if so is not None and so.total_num_scheduled_tokens == len(so.num_scheduled_tokens):
            steps += 1  # pure decode steps are what is timed
            times["schedule"] += t1 - t0
            times["pickle"] += t2 - t1
            times["update"] += t3 - t2
    gc.unfreeze()
    return {k: 1e3 * v / max(steps, 1) for k, v in times.items()} | {"decode_steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num", type=int, default=1000)
    ap.add_argument("--max-seqs", type=int, default=256)
    ap.add_argument("--out-len", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=33024)
    ap.add_argument("--prefix-caching", action="store_true")
    ap.add_argument("--kvc", action="store_true", help="KV-Compress on, no budget (issue 17)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    best: dict[str, float] = {}
    for _ in range(args.repeat):
        r = run(args)
        best = {k: min(v, best.get(k, v)) for k, v in r.items()}
    print("ms per decode step (best of", args.repeat, "runs):",
          {k: round(v, 3) for k, v in best.items()})  # fmt: skip


if __name__ == "__main__":
    main()
