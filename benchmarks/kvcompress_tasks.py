"""Deterministic task data for the KV-Compress quality benchmark, built on token ids.

Both sides of the comparison (our engine and the peer kvpress, in its own venv) read the same
token ids, so nothing depends on how either side would tokenize or template text.

* :func:`needle_tasks` — needle in a haystack of real English text: the stdlib's
  ``pydoc_data.topics`` (the Python reference manual's topics, concatenated in sorted-key
  order), a needle "The special magic number of {city} is {7 digits}." at a depth in [0.1, 0.9]
  and a plain (not chat) question at the end. Correct when the greedy output contains the number.
* :func:`passkey_tasks` — the classic passkey retrieval prompt (repeated filler sentences, "The
  pass key is {5 digits}. Remember it. ..." at a varying depth, "What is the pass key? The pass
  key is").
* :func:`continuation_tasks` — held-out real text (a slice of the topics the haystacks never
  use): context ids and continuation ids, for the teacher-forced loss on a compressed context.

Every retrieval prompt is exactly ``length`` tokens long (the tokenizer's own leading special
tokens, e.g. Gemma's ``<bos>``, included). A task is a dict::

    {"kind": "needle" | "passkey" | "continuation", "length": int, "prompt_ids": list[int],
     "answer": str,           # needle / passkey
     "context_len": int,      # continuation: prompt_ids = context_ids + continuation_ids
     "depth": float}          # needle / passkey: where the answer sits (fraction of the filler)

``length`` is the prompt length for needle / passkey and the context length for continuation.

    python benchmarks/kvcompress_tasks.py [--model HF_DIR] [--out tasks.json]

prints statistics of a default task set (SmolLM2's tokenizer unless ``--model``).
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: Fraction of the topics' characters (cut at a topic boundary) that haystacks draw from; the
#: rest is held out for the continuation tasks.
HAYSTACK_FRACTION = 0.75
DEPTH_MIN, DEPTH_MAX = 0.1, 0.9

CITIES = [
    "Amsterdam", "Athens", "Bangkok", "Barcelona", "Berlin", "Bogota", "Brussels", "Budapest",
    "Buenos Aires", "Cairo", "Chicago", "Copenhagen", "Dublin", "Edinburgh", "Helsinki",
    "Istanbul", "Jakarta", "Johannesburg", "Kyoto", "Lagos", "Lima", "Lisbon", "London",
    "Madrid", "Manila", "Melbourne", "Mexico City", "Montreal", "Moscow", "Mumbai", "Nairobi",
    "Oslo", "Paris", "Prague", "Rome", "Santiago", "Seoul", "Singapore", "Stockholm", "Sydney",
    "Tokyo", "Toronto", "Vienna", "Warsaw", "Zurich",
]  # fmt: skip

PASSKEY_INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize "
    "it. I will quiz you about the important information there."
)
PASSKEY_FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
)
PASSKEY_LINE = "The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_QUESTION = "What is the pass key? The pass key is"

NEEDLE_LINE = "The special magic number of {city} is {number}."
NEEDLE_QUESTION = (
    "\n\nQuestion: What is the special magic number of {city}?\n"
    "Answer: The special magic number of {city} is"
)


def _encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens."""
    return list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])


def _leading_specials(tokenizer: Any) -> list[int]:
    """The ids the tokenizer puts before any text by default (Gemma: ``[<bos>]``; SmolLM2: [])."""
    marker = "x"
    with_special = list(tokenizer(marker, add_special_tokens=True, verbose=False)["input_ids"])
    plain = _encode(tokenizer, marker)
    if plain and with_special[-len(plain) :] == plain:
        return with_special[: len(with_special) - len(plain)]
    return with_special[:1] if len(with_special) > len(plain) else []


def topic_split() -> tuple[list[str], list[str]]:
    """The stdlib's pydoc topic keys in sorted order, split into (haystack keys, held-out
    keys): the first topics up to :data:`HAYSTACK_FRACTION` of the characters, and the rest."""
    from pydoc_data.topics import topics

    keys = sorted(topics)
    total = sum(len(topics[k]) for k in keys)
    hay: list[str] = []
    held: list[str] = []
    seen = 0
    for k in keys:
        (hay if seen < HAYSTACK_FRACTION * total else held).append(k)
        seen += len(topics[k])
    return hay, held


def topics_text() -> tuple[str, str]:
    """Split the stdlib's pydoc topics into (haystack text, held-out text): each part's topics
    (:func:`topic_split`) concatenated, separated by blank lines."""
    from pydoc_data.topics import topics

    hay, held = topic_split()
    return (
        "\n\n".join(topics[k].strip() for k in hay),
        "\n\n".join(topics[k].strip() for k in held),
    )


_POOL_CACHE: dict[tuple[int, str], tuple[list[int], list[int]]] = {}


def _pools(tokenizer: Any) -> tuple[list[int], list[int]]:
    """Token ids of (haystack text, held-out text), cached per tokenizer object."""
    key = (id(tokenizer), getattr(tokenizer, "name_or_path", ""))
    if key not in _POOL_CACHE:
        hay, held = topics_text()
        _POOL_CACHE[key] = (_encode(tokenizer, hay), _encode(tokenizer, held))
    return _POOL_CACHE[key]


def _depths(num: int) -> list[float]:
    """``num`` depths spread evenly over [DEPTH_MIN, DEPTH_MAX] (0.5 for a single sample)."""
    if num == 1:
        return [0.5]
    return [DEPTH_MIN + (DEPTH_MAX - DEPTH_MIN) * i / (num - 1) for i in range(num)]


def _ends_line(tokenizer: Any, token_id: int, memo: dict[int, bool]) -> bool:
    """True when the token's text ends with a newline, possibly followed by indentation (byte-level
    BPE merges a newline with the next line's leading spaces): a clean place to insert a line."""
    if token_id not in memo:
        memo[token_id] = tokenizer.decode([token_id]).rstrip(" \t").endswith("\n")
    return memo[token_id]


def _snap_to_line(tokenizer: Any, ids: Sequence[int], at: int, memo: dict[int, bool]) -> int:
    """The insertion point nearest ``at`` (searching up to 256 tokens back, then forward) right
    after a token ending in a newline; ``at`` itself when none is found."""
    for d in range(257):
        for cand in (at - d, at + d):
            if 0 < cand < len(ids) and _ends_line(tokenizer, ids[cand - 1], memo):
                return cand
    return at


def needle_tasks(
    tokenizer: Any, lengths: Sequence[int], num_per_length: int, seed: int
) -> list[dict[str, Any]]:
    """Needle-in-a-haystack prompts of exactly each length (in tokens), ``num_per_length`` each.

    The haystack is a window of the pydoc topics' tokens starting at a seeded random line; the
    needle line (whole) goes in at a depth spread over [0.1, 0.9] across the samples of a length
    (snapped to the nearest line start), and the question closes the prompt.
    """
    rng = random.Random(seed)
    hay_pool, _ = _pools(tokenizer)
    specials = _leading_specials(tokenizer)
    memo: dict[int, bool] = {}
    tasks: list[dict[str, Any]] = []
    for length in lengths:
        for depth in _depths(num_per_length):
            city = rng.choice(CITIES)
            number = str(rng.randint(1_000_000, 9_999_999))
            needle = _encode(tokenizer, NEEDLE_LINE.format(city=city, number=number) + "\n")
            question = _encode(tokenizer, NEEDLE_QUESTION.format(city=city))
            n_hay = length - len(specials) - len(needle) - len(question)
            if n_hay < 16 or n_hay > len(hay_pool):
                raise ValueError(f"needle length {length} does not fit the haystack source")
            start = rng.randrange(0, len(hay_pool) - n_hay + 1)
            start = _snap_to_line(tokenizer, hay_pool, start, memo)
            start = min(start, len(hay_pool) - n_hay)
            hay = hay_pool[start : start + n_hay]
            at = _snap_to_line(tokenizer, hay, round(depth * n_hay), memo)
            ids = specials + hay[:at] + needle + hay[at:] + question
            assert len(ids) == length
            tasks.append(
                {
                    "kind": "needle",
                    "length": length,
                    "prompt_ids": ids,
                    "answer": number,
                    "depth": round((len(specials) + at) / length, 4),
                }
            )
    return tasks


def passkey_tasks(
    tokenizer: Any, lengths: Sequence[int], num_per_length: int, seed: int
) -> list[dict[str, Any]]:
    """Classic passkey-retrieval prompts of exactly each length (in tokens).

    Layout (lines joined by newlines): intro, filler repeated, the pass key line at a depth
    spread over [0.1, 0.9] (snapped to a whole filler repetition), filler, the question. The
    filler is cut by tokens right before the question to hit the length exactly.
    """
    rng = random.Random(seed)
    specials = _leading_specials(tokenizer)
    intro = _encode(tokenizer, PASSKEY_INTRO + "\n")
    unit = _encode(tokenizer, PASSKEY_FILLER + " ")
    question = _encode(tokenizer, "\n" + PASSKEY_QUESTION)
    tasks: list[dict[str, Any]] = []
    for length in lengths:
        for depth in _depths(num_per_length):
            key = str(rng.randint(10_000, 99_999))
            line = _encode(tokenizer, "\n" + PASSKEY_LINE.format(key=key) + "\n")
            n_fill = length - len(specials) - len(intro) - len(line) - len(question)
            if n_fill < len(unit):
                raise ValueError(f"passkey length {length} is too short")
            reps = min(round(depth * n_fill / len(unit)), n_fill // len(unit))
            before = reps * len(unit)
            after = n_fill - before
            filler_after = (unit * (after // len(unit) + 1))[:after]
            ids = specials + intro + unit * reps + line + filler_after + question
            assert len(ids) == length
            tasks.append(
                {
                    "kind": "passkey",
                    "length": length,
                    "prompt_ids": ids,
                    "answer": key,
                    "depth": round(before / n_fill, 4),
                }
            )
    return tasks


def continuation_tasks(
    tokenizer: Any, context_len: int, cont_len: int, num: int, seed: int
) -> list[dict[str, Any]]:
    """``num`` windows of held-out real text: ``context_len`` context tokens (leading special
    tokens included) followed by ``cont_len`` continuation tokens.

    Windows do not overlap: the held-out tokens are cut into ``num`` equal strides and each
    window starts at a seeded random line start inside its stride.
    """
    rng = random.Random(seed)
    _, held = _pools(tokenizer)
    specials = _leading_specials(tokenizer)
    span = context_len - len(specials) + cont_len
    stride = len(held) // max(num, 1)
    if num < 1 or span > stride:
        raise ValueError(
            f"{num} continuation windows of {span} tokens need {num * span} held-out tokens; "
            f"there are {len(held)}"
        )
    memo: dict[int, bool] = {}
    tasks: list[dict[str, Any]] = []
    for i in range(num):
        lo = i * stride
        start = lo + rng.randrange(0, stride - span + 1)
        start = _snap_to_line(tokenizer, held, start, memo)
        start = min(max(start, lo), lo + stride - span)
        ids = specials + held[start : start + span]
        assert len(ids) == context_len + cont_len
        tasks.append(
            {
                "kind": "continuation",
                "length": context_len,
                "prompt_ids": ids,
                "context_len": context_len,
            }
        )
    return tasks


def write_tasks(path: str | Path, tasks: list[dict[str, Any]]) -> None:
    """Write ``tasks`` as a JSON list (the layout ``benchmarks/peers/kvpress_run.py`` reads)."""
    Path(path).write_text(json.dumps(tasks) + "\n")


def read_tasks(path: str | Path) -> list[dict[str, Any]]:
    """Read tasks written by :func:`write_tasks` (also accepts ``{"tasks": [...]}``)."""
    data = json.loads(Path(path).read_text())
    return list(data["tasks"] if isinstance(data, dict) else data)


def _stats(tokenizer: Any, tasks: list[dict[str, Any]]) -> None:
    """Print counts per kind and length, and the head and tail of one prompt of each kind."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for t in tasks:
        groups.setdefault((t["kind"], t["length"]), []).append(t)
    for (kind, length), ts in sorted(groups.items()):
        lens = sorted({len(t["prompt_ids"]) for t in ts})
        depths = [t["depth"] for t in ts if "depth" in t]
        print(f"{kind:12s} length {length:5d}: {len(ts)} tasks, prompt tokens {lens}, "
              f"depths {depths}, answers {[t.get('answer') for t in ts]}")  # fmt: skip
    shown: set[str] = set()
    for t in tasks:
        if t["kind"] in shown:
            continue
        shown.add(t["kind"])
        ids = t["prompt_ids"]
        cut = t.get("context_len", len(ids))
        print(f"--- {t['kind']} head: {tokenizer.decode(ids[:40])!r}")
        print(f"--- {t['kind']} tail: {tokenizer.decode(ids[cut - 40 : cut])!r}")
        if "answer" in t:
            text = tokenizer.decode(ids)
            i = text.find(t["answer"])
            print(f"--- {t['kind']} needle: {text[max(0, i - 60) : i + 60]!r}")


def main() -> None:
    """Build the default task set for one tokenizer, print statistics, optionally write it."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="HF folder (default: SmolLM2's)")
    ap.add_argument("--needle", default="1024,2048,4096")
    ap.add_argument("--passkey", default="512,1024,2048,4096")
    ap.add_argument("--num", type=int, default=5)
    ap.add_argument("--num-cont", type=int, default=4)
    ap.add_argument("--context-len", type=int, default=2048)
    ap.add_argument("--cont-len", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    model = args.model
    if model is None:
        import sys

        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from benchmarks.models import smollm2_hf_dir

        model = str(smollm2_hf_dir())
    tok = AutoTokenizer.from_pretrained(model)
    hay, held = _pools(tok)
    print(f"haystack source {len(hay)} tokens, held-out {len(held)} tokens")
    tasks = needle_tasks(tok, [int(x) for x in args.needle.split(",")], args.num, seed=1)
    tasks += passkey_tasks(tok, [int(x) for x in args.passkey.split(",")], args.num, seed=2)
    tasks += continuation_tasks(tok, args.context_len, args.cont_len, args.num_cont, seed=3)
    for i, t in enumerate(tasks):
        t["id"] = i
    _stats(tok, tasks)
    if args.out:
        write_tasks(args.out, tasks)
        print("wrote", args.out)


if __name__ == "__main__":
    main()
