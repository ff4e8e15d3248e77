"""Speculative decoding on the CPU with the real SmolLM2-135M-Instruct (the packaged default
model): output tok/s and mean acceptance length without speculation, with prompt lookup
(n-gram) and with suffix decoding, at batch 1 and batch 32, on three workloads:

- ``grounded``: 32 distinct tasks (fix, annotate, rename, rewrite, summarize, list ...) on a
  given text of 200-500 tokens (a short Python module or a news article) - the answer copies
  from the prompt, where prompt lookup and suffix decoding find their drafts;
- ``open``: 32 distinct open questions (little to copy from);
- ``json``: the grounded prompts answered under a JSON schema (structured requests verify
  drafts under the grammar's bitmask at every verified position).

Greedy decoding (temperature 0), so the outputs with and without speculation must be the same
tokens: the script checks it and records the agreement. Batch 1 runs the first 4 prompts one
at a time; batch 32 runs the 32 at once. Each (workload, batch) gets a fresh engine, so suffix
decoding's cache of earlier responses holds only that run's own (and a two-token warm-up
request, untimed, whose drafts are left out of the counts). Writes
``benchmarks/results/spec_decode_SmolLM2-135M-Instruct_cpu[_TAG].json``.

    .venv/bin/python benchmarks/spec_decode_cpu.py
    .venv/bin/python benchmarks/spec_decode_cpu.py --quick     # fewer prompts and tokens
    .venv/bin/python benchmarks/spec_decode_cpu.py --tag paced \\
        --configs off,ngram_paced,suffix_paced

``*_paced``: the same proposers with ``disable_when_slower`` (speculation only at the loads
where the engine measured it faster).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS = Path(__file__).resolve().parent / "results"

CODE = '''def moving_average(values, window):
    """Return the moving averages of values over the given window."""
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    total = 0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window:
            averages.append(total / window)
    return averages


def normalize(values):
    """Scale values so that they sum to one."""
    total = sum(values)
    return [value / total for value in values]


def top_k(values, k):
    """Return the k largest values, largest first."""
    ordered = sorted(values)
    return ordered[:k]
'''
ARTICLE = (
    "The town library opened its new reading room on Monday. The room has forty seats, "
    "long tables with lamps, and shelves for newspapers and magazines from twelve countries. "
    "The library board said the room was paid for by a grant from the regional council and by "
    "donations from local families. Opening hours are from nine in the morning to eight in "
    "the evening on weekdays, and from ten to four on Saturdays. The room is closed on "
    "Sundays. Children under twelve may use the room when an adult is with them. The "
    "librarian, Anna Berg, said that the old reading room was too small and too dark, and "
    "that many readers had asked for a quiet place to study. She thanked the volunteers who "
    "moved more than three thousand books in two weeks. The library will hold a small "
    "celebration on Saturday at eleven, with coffee, music from the school band and a talk "
    "about the history of the building, which was a post office until nineteen sixty."
)
TASKS = [
    "Fix the bug in this code and return the whole corrected code",
    "Add a type hint to every function of this code and return the whole code",
    "Add a comment above every line of this code and return the whole code",
    "Rename every variable of this code to a longer, clearer name and return the whole code",
    "Rewrite this code without the enumerate function and return the whole code",
    "Write a docstring example for every function of this code and return the whole code",
    "Return this code with every function renamed in camelCase",
    "Return this code with four more blank lines between the functions",
    "Rewrite this article in simpler words, keeping every fact",
    "Summarize this article in five sentences",
    "List every number mentioned in this article, with the sentence it appears in",
    "Rewrite this article as a bulleted list of facts",
    "Rewrite this article in the past tense",
    "Copy the sentences of this article that mention times or days",
    "Rewrite this article as a letter from the librarian to the readers",
    "Correct the spelling of this article and return the whole text",
]
# 32 distinct input-grounded prompts (8 code tasks and 8 article tasks, each on its text, and
# the same 16 asking to start with "Sure")
GROUNDED = [
    f"{task}{suffix}:\n\n{CODE if i < 8 else ARTICLE}"
    for suffix in ("", ", starting your answer with the word Sure")
    for i, task in enumerate(TASKS)
]
OPEN = [
    "Why is the sky blue?", "Give three tips for learning a new language.",
    "What makes a good breakfast?", "Explain what a computer network is.",
    "How do bees make honey?", "Why do we have seasons?", "What is a black hole?",
    "How does a bicycle stay upright?", "What is the difference between weather and climate?",
    "Why do cats purr?", "How does a refrigerator keep food cold?",
    "What should I pack for a weekend hike?", "How do vaccines work?",
    "Why is exercise good for the heart?", "What is inflation?", "How do airplanes fly?",
    "What is photosynthesis?", "How can I sleep better?", "Why is the ocean salty?",
    "What is a good way to save money?", "How do volcanoes form?",
    "What is the internet made of?", "Why do leaves change color in autumn?",
    "How does a compass work?", "What is a healthy lunch for school?",
    "Why do we dream?", "How is glass made?", "What causes thunder?",
    "How do I start running as a beginner?", "What are prime numbers?",
    "Why do onions make us cry?", "How does recycling help the planet?",
]  # fmt: skip
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "summary": {"type": "string"},
        "facts": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    },
    "required": ["title", "summary", "facts"],
}
CONFIGS = {
    "off": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
              "prompt_lookup_min": 2},
    "suffix": {"method": "suffix", "num_speculative_tokens": 8},
}  # fmt: skip
# the same proposers, speculating only at the loads where the engine measured it faster
CONFIGS["ngram_paced"] = {**CONFIGS["ngram"], "disable_when_slower": True}
CONFIGS["suffix_paced"] = {**CONFIGS["suffix"], "disable_when_slower": True}
# the n-gram lookup in the runner (PyTorch ops on a CPU), with async scheduling asked for
CONFIGS["ngram_gpu"] = {**CONFIGS["ngram"], "method": "ngram_gpu"}
DEFAULT_CONFIGS = "off,ngram,suffix"


WARMUP = [[{"role": "user", "content": "Hello!"}]]


def _messages(prompts: list[str], n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": prompts[i % len(prompts)]}] for i in range(n)]


def run(args: argparse.Namespace) -> dict:
    from pagedllm import LLM, SamplingParams
    from pagedllm.model.packaged import smollm2_gguf_path
    from pagedllm.sampling_params import StructuredOutputsParams

    model = smollm2_gguf_path()
    max_tokens = 64 if args.quick else args.max_tokens
    batches = {"1": 2 if args.quick else 4, "32": 8 if args.quick else 32}
    results: dict = {}
    reference: dict = {}
    names = args.configs.split(",")
    if names[0] != "off":
        raise SystemExit("--configs must start with off (every speed-up is against it)")
    for name in names:
        spec = CONFIGS[name]
        kw = {"speculative_config": spec} if spec else {}
        if name == "ngram_gpu":
            kw["async_scheduling"] = True
        results[name] = {"speculative_config": spec}
        for workload, prompts in (("grounded", GROUNDED), ("open", OPEN), ("json", GROUNDED)):
            so = StructuredOutputsParams(json=SCHEMA) if workload == "json" else None
            sp = SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=so)
            for batch, count in batches.items():
                # a fresh engine: suffix decoding learns nothing from an earlier run here
                llm = LLM(model, device="cpu", max_model_len=2048, seed=0, **kw)
                # untimed: a fresh engine's first request pays one-time costs (chat template,
                # first kernel calls) that would otherwise land on whichever run comes first
                llm.chat(WARMUP, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
                before = {m.name: m for m in llm.get_metrics()}
                msgs = _messages(prompts, count)
                t = time.perf_counter()
                if batch == "1":
                    outs = [llm.chat([m], sp, use_tqdm=False)[0] for m in msgs]
                else:
                    outs = llm.chat(msgs, sp, use_tqdm=False)
                elapsed = time.perf_counter() - t
                after = {m.name: m for m in llm.get_metrics()}
                del llm
                tokens = [list(o.outputs[0].token_ids) for o in outs]
                n_out = sum(map(len, tokens))
                key = f"{workload}_batch{batch}"
                row = {
                    "requests": count,
                    "output_tokens": n_out,
                    "elapsed_s": elapsed,
                    "output_tokens_per_s": n_out / elapsed,
                }
                if spec:
                    drafts = _delta(before, after, "vllm:spec_decode_num_drafts")
                    acc = _delta(before, after, "vllm:spec_decode_num_accepted_tokens")
                    dtok = _delta(before, after, "vllm:spec_decode_num_draft_tokens")
                    row.update(
                        drafts=drafts,
                        draft_tokens=dtok,
                        accepted_tokens=acc,
                        mean_acceptance_length=1 + acc / drafts if drafts else None,
                        draft_acceptance_rate=acc / dtok if dtok else None,
                    )
                    ref = reference[key]
                    row["speedup"] = row["output_tokens_per_s"] / ref["tok_s"]
                    row["same_tokens"] = tokens == ref["tokens"]
                else:
                    reference[key] = {"tok_s": row["output_tokens_per_s"], "tokens": tokens}
                results[name][key] = row
                print(f"{name:6s} {key:16s} {row['output_tokens_per_s']:7.1f} out tok/s"
                      + (f"  x{row['speedup']:.2f}  acceptance length "
                         f"{row['mean_acceptance_length'] or 0:.2f}  same tokens "
                         f"{row['same_tokens']}" if spec else ""), flush=True)  # fmt: skip
    return results


def _value(metrics: dict, name: str) -> int:
    m = metrics.get(name)
    return int(m.value) if m is not None else 0


def _delta(before: dict, after: dict, name: str) -> int:
    """A counter's growth over the timed run (the warm-up request's part left out)."""
    return _value(after, name) - _value(before, name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS,
                    help=f"comma list, off first, of {list(CONFIGS)}")  # fmt: skip
    ap.add_argument("--tag", default="", help="a name for a run of other --configs")
    ap.add_argument("--out", default="", help="the result file (default: from --tag)")
    args = ap.parse_args()
    import torch

    results = run(args)
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=RESULTS.parent.parent
    ).stdout.strip()
    out = {
        "benchmark": "speculative decoding, CPU, SmolLM2-135M-Instruct (packaged GGUF), greedy",
        "host": {
            "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
        },
        "torch": torch.__version__,
        "commit": commit,
        "max_tokens": 64 if args.quick else args.max_tokens,
        "results": results,
    }
    tag = f"_{args.tag}" if args.tag else ""
    path = Path(args.out or RESULTS / f"spec_decode_SmolLM2-135M-Instruct_cpu{tag}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
