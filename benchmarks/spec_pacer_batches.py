"""``disable_when_slower`` on offline batches where speculation loses: the pacer's own cost.

A tiny random-weight Llama in fp32 on the CPU makes every step host-bound, as the Qwen3-0.6B
shape is at 256 running on an H200: there a speculating step costs ~10x a plain one, so a
paced engine should run plain steps and match the engine without speculation. Engines without
speculation and with n-gram / suffix decoding under ``disable_when_slower`` live side by side
(async scheduling on, as on a GPU); each is warmed up on three batches, then ``--rounds``
rounds of one timed ``LLM.generate`` of ``--batch`` requests per engine, in a rotating order,
each round its own prompts (a 12-token phrase repeated 3 times, so proposers find matches).
Reported: each engine's seconds per round, its ratio to the engine without speculation per
round, their median, and the pacer's record (``SpecPacer.summary()``). Not a GPU figure:
what it isolates is the host work a paused speculation still costs.

    .venv/bin/python benchmarks/spec_pacer_batches.py --out FILE
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pagedllm import LLM, SamplingParams  # noqa: E402
from tests.models.tiny import make_tiny_model  # noqa: E402

CONFIGS: dict[str, dict | None] = {
    "off": None,
    "ngram_paced": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                    "disable_when_slower": True},
    "suffix_paced": {"method": "suffix", "num_speculative_tokens": 4,
                     "disable_when_slower": True},
}  # fmt: skip


def _prompts(n: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(3, 500, 12).tolist() * 3} for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--out", default="benchmarks/results/spec_pacer_batches_cpu.json")
    a = ap.parse_args()
    path = make_tiny_model("llama", "/tmp/pagedllm_bench/tiny_llama")
    names = a.configs.split(",")
    engines = {
        n: LLM(path, dtype="float32", max_model_len=256, max_num_seqs=a.batch,
               speculative_config=CONFIGS[n], async_scheduling=True,
               kv_cache_memory_bytes=256 << 20)
        for n in names
    }  # fmt: skip
    sp = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    for i in range(3):
        for llm in engines.values():
            llm.generate(_prompts(a.batch, i), sp, use_tqdm=False)
    secs: dict[str, list[float]] = {n: [] for n in names}
    for r in range(a.rounds):
        prompts = _prompts(a.batch, 100 + r)
        for n in names[r % len(names) :] + names[: r % len(names)]:
            t = time.perf_counter()
            engines[n].generate(prompts, sp, use_tqdm=False)
            secs[n].append(time.perf_counter() - t)
    result: dict = {
        "benchmark": "disable_when_slower on offline batches, CPU, tiny llama (fp32)",
        "git_commit": os.environ.get("PAGEDLLM_COMMIT"),
        "args": vars(a),
        "engines": {},
    }
    for n in names:
        ratios = [b / s for s, b in zip(secs[n], secs[names[0]])]  # speed vs the first
        row: dict = {"seconds": secs[n], "round_ratios": ratios,
                     "ratio_median": float(np.median(ratios))}  # fmt: skip
        spec = engines[n].llm_engine.engine_core.scheduler.spec
        if spec is not None and spec.pacer is not None:
            row["pacer"] = spec.pacer.summary()
        result["engines"][n] = row
        print(n, "median ratio", round(row["ratio_median"], 3),
              "rounds", [round(x, 3) for x in ratios], flush=True)  # fmt: skip
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
