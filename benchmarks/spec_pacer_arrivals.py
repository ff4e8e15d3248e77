"""``disable_when_slower`` under steady arrivals on the CPU (SmolLM2-135M-Instruct, packaged).

A new request every ``--every`` engine steps (n-gram drafts, greedy, ``--max-tokens`` each),
so that most steps carry a prompt chunk; the pacer then has to time its modes on such steps.
Writes the pacer's summary per load level (ms a step in each mode, the mode it ended in,
steps scheduled in each) and its learned cost of a prompt token. Not a speed benchmark: it
shows which levels got both modes timed.

    .venv/bin/python benchmarks/spec_pacer_arrivals.py --steps 400 --every 1 --out FILE
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--every", type=int, default=1, help="engine steps between two arrivals")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--out", default="")
    a = ap.parse_args()

    from benchmarks.spec_decode_cpu import CONFIGS, GROUNDED, OPEN
    from pagedllm import LLM, SamplingParams
    from pagedllm.model.packaged import smollm2_gguf_path

    llm = LLM(
        smollm2_gguf_path(), device="cpu", max_model_len=2048, seed=0,
        speculative_config=CONFIGS["ngram_paced"],
    )  # fmt: skip
    engine = llm.llm_engine
    pacer = engine.engine_core.scheduler.spec.pacer
    prompts = GROUNDED + OPEN
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens)
    t, added = time.perf_counter(), 0
    for step in range(a.steps):
        if step % a.every == 0:
            engine.add_request(f"r{added}", prompts[added % len(prompts)], params)
            added += 1
        engine.step()
    result = {
        "benchmark": "disable_when_slower under steady arrivals, CPU, SmolLM2-135M-Instruct",
        "git_commit": os.environ.get("PAGEDLLM_COMMIT"),
        "args": vars(a),
        "requests_added": added,
        "elapsed_s": time.perf_counter() - t,
        "prompt_token_s": getattr(pacer, "prompt_token_s", None),
        "pacer": pacer.summary(),
    }
    text = json.dumps(result, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
