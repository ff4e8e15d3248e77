"""RULER-style synthetic tasks on token ids, for the KV-Compress quality suite.

The six task families of RULER (Hsieh et al., 2024) that a compressed cache can fail in
different ways, rebuilt on text this machine has (the stdlib's ``pydoc_data.topics``, the
haystack of ``benchmarks/kvcompress_tasks.py``) and generated from a seed, so every method (our
engine and the kvpress peer) reads the same token ids:

* ``niah_single`` — one needle "One of the special magic numbers for {key} is: {7 digits}." in
  real text, at a depth spread over [0.1, 0.9] across a length's samples.
* ``niah_multikey`` — four needles with different keys at random depths; one is asked for (the
  other three are distractors).
* ``niah_multivalue`` — four needles with the same key and different numbers; all four asked
  for (score: the fraction found).
* ``vt`` — variable tracking: a chain ``VAR A = 12345``, ``VAR B = VAR A``, ... (4 hops) spread
  through repeated noise sentences, with a second chain of another value as a distractor; every
  variable of the asked chain must be named (score: the fraction found).
* ``cwe`` — common-word extraction: a numbered list of words where ten words appear 30 times
  (fewer in short lists: they fill at most half of it, never under 6 times) and the rest 3 times
  each (the list grows with the length); the ten frequent words asked for (score: the fraction
  found).
* ``qa`` — retrieval question over real text: documents (pydoc topics) with a gold one at a
  random depth; the question quotes the start of a sentence of the gold document and asks how
  it goes on; the answer is the sentence's next three words. RULER's QA draws on SQuAD and
  HotpotQA, which cannot be downloaded here: this variant keeps its shape (a question answered by
  one passage among distractor passages of real text) but asks for a quotation, not a fact.

Keys are word pairs ("worker-socket") and list words come from the lower-case words of the
haystack text itself (no word list to download). Scoring is RULER's ``string_match_all``: the
fraction of ``answers`` found in the greedy output (case-insensitive, whitespace collapsed).

A task is a dict::

    {"kind": str, "length": int,  # the nominal prompt length (tokens)
     "prompt_ids": list[int],     # exactly ``length`` tokens (cwe: at most; lists grow by lines)
     "answers": list[str], "new_tokens": int, "depth": float | None}

    python benchmarks/kvc_ruler.py [--model HF_DIR] [--lengths 1024,4096] [--num 2]

prints statistics and one prompt of each kind.
"""

from __future__ import annotations

import argparse
import random
import re
import sys
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

# run as a script, this folder would come first on the path, where a module of it may shadow a
# package of the same name: the repository root goes there instead
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.kvcompress_tasks import (  # noqa: E402
    DEPTH_MAX,
    DEPTH_MIN,
    _depths,
    _encode,
    _leading_specials,
    _pools,
    _snap_to_line,
    topic_split,
)

KINDS = ["niah_single", "niah_multikey", "niah_multivalue", "vt", "cwe", "qa"]

#: Greedy tokens generated per kind: enough for the answer(s) after the prompt's answer prefix.
NEW_TOKENS = {
    "niah_single": 12,
    "niah_multikey": 12,
    "niah_multivalue": 40,
    "vt": 32,
    "cwe": 64,
    "qa": 12,
}

NIAH_INTRO = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize "
    "it. I will quiz you about the numbers afterwards.\n"
)
NIAH_NEEDLE = "One of the special magic numbers for {key} is: {value}."
NIAH_Q_ONE = (
    "\nWhat is the special magic number for {key} mentioned in the provided text? "
    "The special magic number for {key} mentioned in the provided text is"
)
NIAH_Q_ALL = (
    "\nWhat are all the special magic numbers for {key} mentioned in the provided text? "
    "The special magic numbers for {key} mentioned in the provided text are"
)
VT_INTRO = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
)
VT_NOISE = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
)
VT_QUESTION = (
    "\nQuestion: Find all variables that are assigned the value {value} in the text above. "
    "Answer: According to the chain(s) of variable assignment in the text above, {n} variables "
    "are assigned the value {value}, they are:"
)
CWE_INTRO = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n"
)
CWE_QUESTION = (
    "\nQuestion: What are the 10 most common words in the above list? Answer: The top 10 words "
    "that appear most often in the list are:"
)
QA_INTRO = (
    "Answer the question based on the given documents.\n\nThe following are given documents.\n\n"
)
QA_QUESTION = (
    '\n\nQuestion: In the documents above, which three words come right after "{prefix}"? '
    'Answer: "{prefix}'
)

NUM_KEYS = 4  # multikey: needles (one asked); multivalue: values of the one key
VT_HOPS = 4  # variables per chain = hops + 1
CWE_COMMON, CWE_FREQ_COMMON, CWE_FREQ_RARE = 10, 30, 3


def normalize(text: str) -> str:
    """Lower case, whitespace collapsed: what scoring compares."""
    return " ".join(text.lower().split())


def score(output: str, answers: Sequence[str]) -> float:
    """RULER's ``string_match_all``: the fraction of ``answers`` found in ``output``."""
    out = normalize(output)
    return sum(normalize(a) in out for a in answers) / max(1, len(answers))


@lru_cache(maxsize=1)
def _words() -> tuple[str, ...]:
    """Distinct lower-case words (4–10 letters) of the haystack text, sorted: the vocabulary of
    keys and lists (deterministic, no download)."""
    from benchmarks.kvcompress_tasks import topics_text

    hay, _ = topics_text()
    return tuple(sorted(set(re.findall(r"\b[a-z]{4,10}\b", hay))))


def _key(rng: random.Random, used: set[str]) -> str:
    """A fresh two-word key, e.g. ``"worker-socket"``."""
    words = _words()
    while True:
        key = f"{rng.choice(words)}-{rng.choice(words)}"
        if key not in used:
            used.add(key)
            return key


def _haystack(tokenizer: Any, rng: random.Random, n: int, memo: dict[int, bool]) -> list[int]:
    """``n`` tokens of real text starting at a seeded random line of the haystack source."""
    pool, _ = _pools(tokenizer)
    if n > len(pool):
        raise ValueError(f"a haystack of {n} tokens does not fit the source ({len(pool)})")
    start = _snap_to_line(tokenizer, pool, rng.randrange(0, len(pool) - n + 1), memo)
    start = min(start, len(pool) - n)
    return pool[start : start + n]


def _insert(
    tokenizer: Any, hay: list[int], pieces: Sequence[tuple[float, list[int]]], memo: dict
) -> tuple[list[int], list[float]]:
    """Insert each ``(depth, ids)`` piece at that fraction of ``hay`` (snapped to a line start).
    Returns the ids and where each piece starts (fraction of the result)."""
    spots = sorted(
        (_snap_to_line(tokenizer, hay, round(d * len(hay)), memo), i)
        for i, (d, _) in enumerate(pieces)
    )
    out: list[int] = []
    starts = [0.0] * len(pieces)
    last = 0
    for at, i in spots:
        out += hay[last:at]
        starts[i] = len(out)
        out += pieces[i][1]
        last = at
    out += hay[last:]
    return out, [s / max(1, len(out)) for s in starts]


def _niah(tokenizer: Any, length: int, rng: random.Random, depth: float, kind: str, memo: dict):
    """One needle task of ``kind`` (single / multikey / multivalue)."""
    enc = lambda s: _encode(tokenizer, s)  # noqa: E731
    used: set[str] = set()
    key = _key(rng, used)
    values = [str(rng.randint(1_000_000, 9_999_999)) for _ in range(NUM_KEYS)]
    if kind == "niah_single":
        needles = [(depth, key, values[0])]
        question, answers = NIAH_Q_ONE.format(key=key), values[:1]
    elif kind == "niah_multikey":
        others = [_key(rng, used) for _ in range(NUM_KEYS - 1)]
        needles = [(depth, key, values[0])] + [
            (rng.uniform(DEPTH_MIN, DEPTH_MAX), k, v) for k, v in zip(others, values[1:])
        ]
        question, answers = NIAH_Q_ONE.format(key=key), values[:1]
    else:
        needles = [(rng.uniform(DEPTH_MIN, DEPTH_MAX), key, v) for v in values]
        question, answers = NIAH_Q_ALL.format(key=key), values
    pieces = [(d, enc(NIAH_NEEDLE.format(key=k, value=v) + "\n")) for d, k, v in needles]
    head, q = _leading_specials(tokenizer) + enc(NIAH_INTRO), enc(question)
    n_hay = length - len(head) - len(q) - sum(len(p) for _, p in pieces)
    ids, starts = _insert(tokenizer, _haystack(tokenizer, rng, n_hay, memo), pieces, memo)
    return head + ids + q, answers, starts[0]


def _vt(tokenizer: Any, length: int, rng: random.Random, depth: float, memo: dict):
    """Two chains of ``VT_HOPS`` hops in repeated noise; the first one's variables asked."""
    enc = lambda s: _encode(tokenizer, s)  # noqa: E731
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    names: set[str] = set()
    while len(names) < 2 * (VT_HOPS + 1):
        names.add("".join(rng.choice(letters) for _ in range(5)))
    order = sorted(names)
    rng.shuffle(order)
    chains = [order[: VT_HOPS + 1], order[VT_HOPS + 1 :]]
    value, other = rng.sample(range(10_000, 100_000), 2)
    lines: list[tuple[float, list[int]]] = []
    for chain, val, lo in ((chains[0], value, depth), (chains[1], other, None)):
        # the asked chain starts at ``depth`` and spreads over the rest; the distractor anywhere
        span = sorted(rng.uniform(DEPTH_MIN, DEPTH_MAX) for _ in chain) if lo is None else [
            lo + (DEPTH_MAX - lo) * i / len(chain) for i in range(len(chain))
        ]  # fmt: skip
        for i, (name, d) in enumerate(zip(chain, span)):
            rhs = str(val) if i == 0 else f"VAR {chain[i - 1]}"
            lines.append((d, enc(f"VAR {name} = {rhs}.\n")))
    head = _leading_specials(tokenizer) + enc(VT_INTRO)
    q = enc(VT_QUESTION.format(value=value, n=VT_HOPS + 1))
    unit = enc(VT_NOISE + "\n")
    n_fill = length - len(head) - len(q) - sum(len(p) for _, p in lines)
    if n_fill < len(unit):
        raise ValueError(f"vt length {length} is too short")
    noise = (unit * (n_fill // len(unit) + 1))[:n_fill]
    ids, _ = _insert(tokenizer, noise, lines, memo)
    return head + ids + q, chains[0], depth


def _cwe(tokenizer: Any, length: int, rng: random.Random):
    """A numbered word list filling ``length`` (by whole lines); the ten frequent words asked."""
    enc = lambda s: _encode(tokenizer, s)  # noqa: E731
    words = list(_words())
    rng.shuffle(words)
    common, rare_pool = words[:CWE_COMMON], words[CWE_COMMON:]
    head = _leading_specials(tokenizer) + enc(CWE_INTRO)
    q = enc(CWE_QUESTION)
    room = length - len(head) - len(q)

    # the frequent words fill at most half the list at 30 repeats each (fewer when the list is
    # short: 1K tokens hold ~190 lines), never fewer than twice the rare words' repeats
    per_line = len(enc("".join(f"{i + 101}. {w}\n" for i, w in enumerate(common)))) / CWE_COMMON
    freq = max(2 * CWE_FREQ_RARE, min(CWE_FREQ_COMMON, int(room / 2 / per_line / CWE_COMMON)))

    def build(n_rare: int) -> list[int]:
        items = common * freq + rare_pool[:n_rare] * CWE_FREQ_RARE
        rng_l = random.Random(n_rare * 7919 + len(common))
        rng_l.shuffle(items)
        return enc("".join(f"{i + 1}. {w}\n" for i, w in enumerate(items)))

    lo, hi = 0, len(rare_pool)  # the most rare words whose list fits: binary search
    if len(build(0)) > room:
        raise ValueError(f"cwe length {length} is too short for {CWE_COMMON} common words")
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(build(mid)) <= room:
            lo = mid
        else:
            hi = mid - 1
    return head + build(lo) + q, common, None


def _sentences(text: str) -> list[str]:
    """Plain prose sentences of ``text`` (12–40 words of letters and simple punctuation, no word
    hyphenated across a line break)."""
    flat = " ".join(text.split())
    out = []
    for s in re.split(r"(?<=[.!?])\s+", flat):
        words = s.split()
        if 12 <= len(words) <= 40 and re.fullmatch(r"[A-Za-z ,;:'()\-.]+", s) and "- " not in s:
            out.append(s)
    return out


@lru_cache(maxsize=1)
def _qa_sources() -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(haystack topic keys, those with a quotable sentence, each haystack topic's text with
    whitespace collapsed - where a quoted start must occur once)."""
    from pydoc_data.topics import topics

    hay_keys = tuple(topic_split()[0])
    gold_keys = tuple(k for k in hay_keys if _sentences(topics[k]))
    return hay_keys, gold_keys, tuple(" ".join(topics[k].split()) for k in hay_keys)


def _qa(tokenizer: Any, length: int, rng: random.Random, depth: float):
    """Documents of real text, a gold one at ``depth``; quote a sentence's start, ask the rest."""
    from pydoc_data.topics import topics

    enc = lambda s: _encode(tokenizer, s)  # noqa: E731
    hay_keys, gold_keys, flat = _qa_sources()
    budget = length // 3  # the gold document's tokens at most (cut at the end)
    for _ in range(200):
        gold = rng.choice(gold_keys)
        gold_ids = enc(f"Document (gold):\n{topics[gold].strip()}\n\n")
        cut_doc = len(gold_ids) > budget
        gold_ids = gold_ids[:budget]
        sents = _sentences(tokenizer.decode(gold_ids))
        sents = sents[:-1] if cut_doc else sents  # the last one may be cut
        if not sents:
            continue
        words = rng.choice(sents).split()
        cut = min(len(words) - 3, rng.randint(8, 14))
        prefix, answer = " ".join(words[:cut]), " ".join(words[cut : cut + 3]).rstrip(".,;:")
        # the quoted start must be unique among every document that could join the prompt
        if sum(text.count(prefix) for text in flat) == 1:
            break
    else:
        raise ValueError(f"no unique sentence found for a qa task of length {length}")
    others = [k for k in hay_keys if k != gold]
    rng.shuffle(others)
    head = _leading_specials(tokenizer) + enc(QA_INTRO)
    q = enc(QA_QUESTION.format(prefix=prefix))
    room = length - len(head) - len(q) - len(gold_ids)
    if room < 0:
        raise ValueError(f"qa length {length} is too short for its gold document")
    docs: list[list[int]] = []
    for i, k in enumerate(others):
        if room <= 0:
            break
        d = enc(f"Document {i + 1}:\n{topics[k].strip()}\n\n")[:room]
        docs.append(d)
        room -= len(d)
    at = min(len(docs), round(depth * len(docs)))
    ids = [t for d in docs[:at] for t in d] + gold_ids + [t for d in docs[at:] for t in d]
    ids = head + ids + q
    return ids, [answer], (len(head) + sum(len(d) for d in docs[:at])) / len(ids)


def ruler_tasks(
    tokenizer: Any,
    lengths: Sequence[int],
    num_per_length: int,
    seed: int,
    kinds: Sequence[str] = KINDS,
) -> list[dict[str, Any]]:
    """``num_per_length`` tasks of every kind and length, generated from ``seed``."""
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise ValueError(f"unknown task kinds {unknown}; known: {KINDS}")
    memo: dict[int, bool] = {}
    tasks: list[dict[str, Any]] = []
    for kind in kinds:
        for length in lengths:
            rng = random.Random(f"{seed}:{kind}:{length}")
            for depth in _depths(num_per_length):
                if kind == "vt":
                    ids, answers, where = _vt(tokenizer, length, rng, depth, memo)
                elif kind == "cwe":
                    ids, answers, where = _cwe(tokenizer, length, rng)
                elif kind == "qa":
                    ids, answers, where = _qa(tokenizer, length, rng, depth)
                else:
                    ids, answers, where = _niah(tokenizer, length, rng, depth, kind, memo)
                if len(ids) > length or (kind != "cwe" and len(ids) != length):
                    raise AssertionError(f"{kind} prompt of {len(ids)} tokens for {length}")
                tasks.append(
                    {
                        "kind": kind,
                        "length": length,
                        "prompt_ids": ids,
                        "answers": list(answers),
                        "new_tokens": NEW_TOKENS[kind],
                        "depth": None if where is None else round(where, 4),
                    }
                )
    return tasks


def main() -> None:
    """Print statistics of a small task set and the tail of one prompt of each kind."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="HF folder (default: SmolLM2's)")
    ap.add_argument("--lengths", default="1024,4096")
    ap.add_argument("--num", type=int, default=2)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    model = args.model
    if model is None:
        from benchmarks.models import smollm2_hf_dir

        model = str(smollm2_hf_dir())
    tok = AutoTokenizer.from_pretrained(model)
    tasks = ruler_tasks(tok, [int(x) for x in args.lengths.split(",")], args.num, seed=0)
    shown: set[str] = set()
    for t in tasks:
        print(f"{t['kind']:16s} {t['length']:6d} tokens {len(t['prompt_ids']):6d} "
              f"depth {t['depth']} answers {t['answers']}")  # fmt: skip
        if t["kind"] not in shown:
            shown.add(t["kind"])
            print("   ...", repr(tok.decode(t["prompt_ids"][-80:])))


if __name__ == "__main__":
    main()
