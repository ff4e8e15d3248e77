"""``pagedllm bench sharing``: memory saved by sharing blocks (the PagedAttention paper's
Figure 15): blocks saved / blocks needed without sharing, averaged over the steps of a run, for
parallel sampling (n = 2, 4, 6) and beam search (width 2, 4, 6) on an Alpaca-like workload
(short prompts) and a ShareGPT-like one (long prompts)."""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from pagedllm.beam_search import BeamSearchParams
from pagedllm.bench._flags import add_dtype
from pagedllm.sampling_params import SamplingParams

WORKLOADS = {
    # (prompt length range, output length range), after the paper's dataset statistics
    "alpaca": ((10, 30), (40, 80)),
    "sharegpt": ((80, 400), (150, 400)),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark's flags."""
    p.add_argument("--model", required=True, help="HF model folder or .gguf file (required).")
    add_dtype(p, default="float32")
    p.add_argument(
        "--num-requests", type=int, default=8, metavar="N", help="Requests per workload and width."
    )
    p.add_argument(
        "--max-model-len", type=int, default=1024, metavar="N", help="Context length of the engine."
    )
    p.add_argument(
        "--seed", type=int, default=0, metavar="N", help="Seed of the workload and the sampling."
    )
    p.add_argument(
        "--out",
        default="benchmarks/results",
        metavar="DIR",
        help="Folder of the result, sharing_memory_saving.json.",
    )


class SharingMeter:
    """After every step: table entries (blocks needed without sharing) vs distinct blocks."""

    def __init__(self, llm) -> None:  # noqa: ANN001
        core = llm.llm_engine.engine_core
        self.kv = core.scheduler.kv_cache_manager
        self.needed = 0
        self.used = 0
        orig = core.step

        def step():  # noqa: ANN202
            out = orig()
            tables = self.kv.req_to_blocks.values()
            entries = sum(len(t) for t in tables)
            distinct = len({b.block_id for t in tables for b in t})
            self.needed += entries
            self.used += distinct
            return out

        core.step = step

    @property
    def saving(self) -> float:
        return (self.needed - self.used) / max(1, self.needed)


def run(args: argparse.Namespace) -> dict:
    from pagedllm import LLM

    result: dict = {"bench": "sharing", "model": args.model, "workloads": {}}
    for name, ((p_lo, p_hi), (o_lo, o_hi)) in WORKLOADS.items():
        rng = np.random.default_rng(args.seed)
        prompts = [
            rng.integers(100, 400, size=int(rng.integers(p_lo, p_hi + 1))).tolist()
            for _ in range(args.num_requests)
        ]
        outs = [int(rng.integers(o_lo, o_hi + 1)) for _ in prompts]
        rows = {}
        for kind in ("parallel", "beam"):
            for width in (2, 4, 6):
                llm = LLM(
                    args.model,
                    dtype=args.dtype,
                    max_model_len=args.max_model_len,
                    enable_prefix_caching=False,
                    seed=args.seed,
                )
                meter = SharingMeter(llm)
                if kind == "parallel":
                    llm.generate(
                        [{"prompt_token_ids": p} for p in prompts],
                        [
                            SamplingParams(
                                n=width, temperature=1.0, seed=i, max_tokens=o, ignore_eos=True
                            )
                            for i, o in enumerate(outs)
                        ],
                        use_tqdm=False,
                    )
                else:
                    for p, o in zip(prompts, outs):
                        llm.beam_search(
                            [{"prompt_token_ids": p}],
                            BeamSearchParams(beam_width=width, max_tokens=o, ignore_eos=True),
                        )
                rows[f"{kind}_{width}"] = meter.saving
        result["workloads"][name] = rows
    return result


def main(args: argparse.Namespace) -> None:
    result = run(args)
    result["time"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "sharing_memory_saving.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
        for ax, kind in zip(axes, ("parallel", "beam")):
            for j, (name, rows) in enumerate(result["workloads"].items()):
                vals = [100 * rows[f"{kind}_{w}"] for w in (2, 4, 6)]
                ax.bar(np.arange(3) + 0.35 * j, vals, 0.35, label=name)
            ax.set_xticks(np.arange(3) + 0.175, ["2", "4", "6"])
            ax.set_xlabel("n" if kind == "parallel" else "beam width")
            ax.set_ylabel("memory saving (%)")
            ax.set_title(kind)
            ax.legend()
        fig.tight_layout()
        fig.savefig(path[:-5] + ".png", dpi=100)
        plt.close(fig)
    except ImportError:
        pass
    print(json.dumps(result["workloads"], indent=2))
    print(f"wrote {path}")
