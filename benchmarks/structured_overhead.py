"""Structured-output overhead on any device: a JSON-schema-constrained batch vs the same batch
unconstrained doing equal work (the free run gets each request's constrained output length).

    python benchmarks/structured_overhead.py --model PATH [--tokenizer DIR] [--num 64]
        [--grammar-process auto|on|off]

``--grammar-process``: the grammars in a worker process (on), in the engine loop (off), or
the device's default (auto: on with a GPU, off on a CPU); a run that is not auto writes
``structured_overhead_<device>_grammar_process_<on|off>.json``.
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
from pagedllm.bench.throughput import device_name  # noqa: E402
from pagedllm.structured_output.params import StructuredOutputsParams  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "tags"]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--grammar-process", choices=["auto", "on", "off"], default="auto")
    args = p.parse_args()
    process = {"auto": None, "on": True, "off": False}[args.grammar_process]
    llm = LLM(args.model, tokenizer=args.tokenizer, dtype=args.dtype, max_model_len=1024,
              grammar_process=process)
    prompts = ["Describe a person as JSON:"] * args.num
    so = StructuredOutputsParams(json=SCHEMA)
    constrained = [SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_tokens,
                                  structured_outputs=so) for i in range(args.num)]
    llm.generate(prompts[:2], constrained[:2], use_tqdm=False)
    res: dict = {"device": device_name(llm.llm_engine.engine_core.model_runner.device),
                 "model": args.model, "num_requests": args.num, "schema": SCHEMA,
                 "grammar_process": llm.llm_engine.config.scheduler_config.grammar_process}
    for _ in range(args.repeats):
        t = time.perf_counter()
        outs = llm.generate(prompts, constrained, use_tqdm=False)
        el = time.perf_counter() - t
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        valid = sum(1 for o in outs if _valid(o.outputs[0].text))
        res.setdefault("constrained_tok_s", []).append(sum(lengths) / el)
        free = [SamplingParams(temperature=1.0, seed=i, max_tokens=n, ignore_eos=True)
                for i, n in enumerate(lengths)]
        t = time.perf_counter()
        llm.generate(prompts, free, use_tqdm=False)
        res.setdefault("free_tok_s", []).append(sum(lengths) / (time.perf_counter() - t))
        res["valid_json_fraction"] = valid / args.num
        res["mean_output_len"] = float(np.mean(lengths))
    c, f = np.median(res["constrained_tok_s"]), np.median(res["free_tok_s"])
    res["overhead_fraction"] = 1 - c / f
    os.makedirs(args.out, exist_ok=True)
    tag = "" if process is None else f"_grammar_process_{args.grammar_process}"
    name = f"structured_overhead_{res['device']}{tag}.json".replace(" ", "_")
    path = os.path.join(args.out, name)
    with open(path, "w") as f:
        json.dump(res, f, indent=2)
    print(json.dumps(res, indent=2))


def _valid(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


if __name__ == "__main__":
    main()
