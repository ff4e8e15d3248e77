"""The engine core's host work per step, with no model: the scheduler's ``schedule`` and
``update_from_output`` and the plan's pickling (what the multiprocess executor sends), on
Benchmark B's request shape (prompt 128, output ``--out-len``, greedy, ``ignore_eos``) with
``--max-seqs`` running, pipelined as async scheduling runs them (step N is scheduled before
step N-1's tokens come back). Under tensor parallelism these sit on the chain from one
step's tokens to the next step's launch (see benchmarks/README.md), so they bound the step
time when the device is fast.

    python benchmarks/host_sched_micro.py [--num 1000 --max-seqs 256 --out-len 256]

``--kvc-budget M``: KV-Compress with a budget (Llama-3.1-8B's 32 x 8 KV heads; every request
``max_cache_tokens`` M, protected window 32, compressed after its prompt and under memory
pressure, as Benchmark D runs it) - set ``--prompt-len`` and a ``--blocks`` short of the
requests' uncompressed needs. The device's side of each eviction is stood in for, outside the
timed parts, by a rule with KV-Compress's shape: each compressible head keeps a random share
of the budget in whole blocks (the request then holds its budget within a block), at least the
protected window, at most what it holds.

    python benchmarks/host_sched_micro.py --kvc-budget 128 --prompt-len 500 --out-len 500 \
        --num 256 --blocks 2048
"""

from __future__ import annotations

import argparse
import gc
import math
import pickle
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedllm.config import CacheConfig, KVCompressConfig, SchedulerConfig  # noqa: E402
from pagedllm.core.kv_cache.spec import HeadPagedSpec, KVCacheGroup, KVCacheGroups  # noqa: E402
from pagedllm.core.request import Request  # noqa: E402
from pagedllm.core.sched.output import ModelRunnerOutput  # noqa: E402
from pagedllm.core.sched.scheduler import Scheduler  # noqa: E402
from pagedllm.sampling_params import SamplingParams  # noqa: E402

WINDOW = 32  # --kvc-budget's protected window


def fake_evictions(sched: Scheduler, so, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Each eviction's new lengths [LH] as the device would return them (see the module
    docstring): a head keeps its random share of the budget in whole blocks (rounded down,
    then a block more for the largest remainders until the request holds its budget within a
    block), at least the window rounded up to whole blocks, at most what it held."""
    kvm = sched.kv_cache_manager
    bs = kvm.block_size
    out = {}
    for e in so.kvc_compress:
        state = kvm.states.get(e.req_id)
        if state is None:
            continue
        # [LH] at the eviction's step (an older scheduler applied them before the next step)
        computed = getattr(e, "computed", None)
        if computed is None:
            computed = sched.requests[e.req_id].num_computed_tokens
        held = state.lens - (state.num_tokens - computed)
        share = rng.dirichlet(np.full(len(held), 4.0)) * e.budget
        keep = share // bs * bs
        # whole blocks to the heads with the largest remainders until the request holds its
        # budget within a block (the device takes chunks while it holds more than its budget)
        extra = int((e.budget - keep.sum()) // bs)
        keep[np.argsort(keep - share)[:extra]] += bs
        keep = np.maximum(keep, math.ceil(WINDOW / bs) * bs).astype(np.int64)
        out[e.req_id] = np.minimum(held, np.where(kvm.compressible, keep, held))
    return out


def run(args: argparse.Namespace) -> dict[str, float]:
    groups, kvc, blocks = None, None, args.blocks
    budget = {}
    if args.kvc or args.kvc_budget:
        # KV-Compress, Qwen3-0.6B's shape without a budget (Benchmark A: 28 layers x 8 KV
        # heads), Llama-3.1-8B's with one (32 x 8): one block per (layer, head), so 224x (256x)
        # the block ids of the same token count
        layers, heads = (32, 8) if args.kvc_budget else (28, 8)
        spec = HeadPagedSpec(16, heads, 128, 2, num_layers=layers, compressible=(True,) * layers)
        groups = KVCacheGroups((KVCacheGroup(spec, tuple(range(layers))),), 1, (spec,))
        kvc = KVCompressConfig(enabled=True, compress_once=True, protected_window_size=WINDOW)
        blocks = args.blocks * layers * heads
        if args.kvc_budget:
            budget = dict(max_cache_tokens=args.kvc_budget)
    rng = np.random.default_rng(0)
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=args.max_seqs,
                        max_model_len=args.max_model_len, enable_chunked_prefill=True),
        CacheConfig(block_size=16, enable_prefix_caching=args.prefix_caching),
        blocks, 0, kv_groups=groups, kvc_config=kvc,
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=args.out_len, ignore_eos=True, **budget)
    for i in range(args.num):
        start = 1 + i * 1000
        sched.add_request(Request(str(i), list(range(start, start + args.prompt_len)), params,
                                  eos_token_id=2, arrival_time=float(i)))  # fmt: skip
    times = {"schedule": 0.0, "update": 0.0, "pickle": 0.0}
    steps = all_steps = running = waits = 0
    pending = None
    gc.freeze()
    clock = time.perf_counter
    evicted = [0]

    def update(last) -> float:
        """Step ``last``'s results into the scheduler; returns the seconds it took."""
        ids = list(last.num_scheduled_tokens)
        reqs = sched.requests  # (one that finished in step N - 1 is gone: N drops it)
        toks = [[7] if r in reqs and reqs[r].num_output_placeholders else [] for r in ids]
        lens = fake_evictions(sched, last, rng) if last.kvc_compress else {}
        evicted[0] += len(lens)
        t = clock()  # (the stand-in for the device is not timed)
        sched.update_from_output(
            last, ModelRunnerOutput(req_ids=ids, sampled_token_ids=toks, kvc_lens=lens)
        )
        return clock() - t

    while sched.has_unfinished_requests() or pending is not None:
        spent = 0.0
        # results first: a synchronous step, or evictions in flight free what this one needs
        # (the engine core's rule: ``Scheduler.wants_evictions_landed``)
        if pending is not None and (
            args.sync or sched.needs_sync or sched.wants_evictions_landed()
        ):
            waits += not args.sync
            spent += update(pending)
            pending = None
        t0 = clock()
        so = sched.schedule() if sched.has_unfinished_requests() else None
        t1 = clock()
        if so is not None:
            pickle.dumps(so, protocol=pickle.HIGHEST_PROTOCOL)
        t2 = clock()
        if pending is not None:
            spent += update(pending)
        if so is not None:
            all_steps += 1
            running += len(so.num_scheduled_tokens)
        pending = so
        if so is not None and so.total_num_scheduled_tokens == len(so.num_scheduled_tokens):
            steps += 1  # pure decode steps are what is timed
            times["schedule"] += t1 - t0
            times["pickle"] += t2 - t1
            times["update"] += spent
    gc.unfreeze()
    return {k: 1e3 * v / max(steps, 1) for k, v in times.items()} | {
        "decode_steps": steps,
        "steps": all_steps,
        "scheduled_mean": running / max(all_steps, 1),
        "evictions": evicted[0],
        "results_first": waits,  # async steps that took the last step's results first
        "preemptions": sched.num_preemptions,
        "prefix_copy_blocks": getattr(sched.kv_cache_manager, "num_prefix_copies", 0),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num", type=int, default=1000)
    ap.add_argument("--max-seqs", type=int, default=256)
    ap.add_argument("--out-len", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=33024)
    ap.add_argument("--prefix-caching", action="store_true")
    ap.add_argument("--kvc", action="store_true", help="KV-Compress on, no budget (issue 17)")
    ap.add_argument("--kvc-budget", type=int, default=0, help="KV-Compress, max_cache_tokens")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--sync", action="store_true", help="synchronous steps (no pipelining)")
    args = ap.parse_args()
    best: dict[str, float] = {}
    for _ in range(args.repeat):
        r = run(args)
        best = {k: min(v, best.get(k, v)) for k, v in r.items()}  # (counts: the same each run)
    print("ms per decode step (best of", args.repeat, "runs):",
          {k: round(v, 3) for k, v in best.items()})  # fmt: skip


if __name__ == "__main__":
    main()
