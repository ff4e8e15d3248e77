"""The KV-Compress quality suite's own logic (``benchmarks/kvc_ruler.py``,
``benchmarks/kvcompress_quality.py``): tasks of exact lengths whose answers sit in the prompt,
RULER's scoring, and the statistics that decide a win, a loss or a tie."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from benchmarks import kvc_ruler
from benchmarks import kvcompress_quality as q


@pytest.fixture(scope="module")
def tok(tiny_models):
    return AutoTokenizer.from_pretrained(tiny_models("llama"))


def test_tasks_have_exact_lengths_and_their_answers_in_the_prompt(tok) -> None:
    tasks = kvc_ruler.ruler_tasks(tok, [1024, 2048], 3, seed=0)
    assert sorted({t["kind"] for t in tasks}) == sorted(kvc_ruler.KINDS)
    assert len(tasks) == len(kvc_ruler.KINDS) * 2 * 3
    for t in tasks:
        n = len(t["prompt_ids"])
        assert n == t["length"] or (t["kind"] == "cwe" and t["length"] - 64 < n <= t["length"])
        text = kvc_ruler.normalize(tok.decode(t["prompt_ids"]))
        for a in t["answers"]:
            assert kvc_ruler.normalize(a) in text, (t["kind"], a)
        assert t["new_tokens"] == kvc_ruler.NEW_TOKENS[t["kind"]]
    # the needle families put their needle where the depth says (spread over [0.1, 0.9])
    single = [t["depth"] for t in tasks if t["kind"] == "niah_single" and t["length"] == 2048]
    assert single == sorted(single) and single[0] < 0.3 < 0.7 < single[-1]


def test_cwe_asks_for_the_words_that_really_are_the_most_common(tok) -> None:
    (t,) = kvc_ruler.ruler_tasks(tok, [2048], 1, seed=3, kinds=["cwe"])
    text = tok.decode(t["prompt_ids"])
    listing = text.split("\nQuestion:")[0].split("\n")[1:]
    counts: dict[str, int] = {}
    for line in filter(None, listing):
        word = line.split(". ", 1)[1]
        counts[word] = counts.get(word, 0) + 1
    top = sorted(counts, key=counts.get, reverse=True)[:10]
    assert sorted(top) == sorted(t["answers"])
    assert min(counts[w] for w in t["answers"]) > max(
        c for w, c in counts.items() if w not in t["answers"]
    )


def test_tasks_are_seeded(tok) -> None:
    a = kvc_ruler.ruler_tasks(tok, [1024], 2, seed=5)
    b = kvc_ruler.ruler_tasks(tok, [1024], 2, seed=5)
    c = kvc_ruler.ruler_tasks(tok, [1024], 2, seed=6)
    assert a == b
    assert [t["prompt_ids"] for t in a] != [t["prompt_ids"] for t in c]
    with pytest.raises(ValueError, match="unknown task kinds"):
        kvc_ruler.ruler_tasks(tok, [1024], 1, seed=0, kinds=["niah_single", "nope"])


def test_score_is_the_fraction_of_answers_found() -> None:
    assert kvc_ruler.score(" 123 and\n  456.", ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert kvc_ruler.score("The Answer IS   here", ["answer is here"]) == 1.0
    assert kvc_ruler.score("12", ["123"]) == 0.0


def _runs(scores_a: list[float], scores_b: list[float]) -> tuple[list[dict], dict]:
    n = len(scores_a)
    tasks = [{"id": i, "kind": "niah_single", "length": 1024} for i in range(n)]

    def recs(s: list[float]) -> list[dict]:  # noqa: E306
        return [{"id": i, "score": x, "kept_kvs": 10, "full_kvs": 80} for i, x in enumerate(s)]

    runs = {"full": {"1": recs([1.0] * n)}, "kvcompress": {"8": recs(scores_a)},
            "other": {"8": recs(scores_b)}}  # fmt: skip
    return tasks, runs


def test_compare_claims_a_win_only_outside_the_interval() -> None:
    tasks, runs = _runs([1.0] * 40, [0.0] * 40)
    assert q.compare(tasks, runs, "kvcompress", 500)["other"]["8"]["verdict"] == "win"
    tasks, runs = _runs([0.0] * 40, [1.0] * 40)
    assert q.compare(tasks, runs, "kvcompress", 500)["other"]["8"]["verdict"] == "loss"
    # one sample apart in 40: the interval holds 0
    tasks, runs = _runs([1.0] + [0.0] * 39, [0.0] * 40)
    cmp = q.compare(tasks, runs, "kvcompress", 500)["other"]["8"]
    assert cmp["verdict"] == "tie" and cmp["ci"][0] <= 0 <= cmp["ci"][1]
    s = q.summarize(tasks, runs, 500)["methods"]
    assert s["kvcompress"]["8"]["avg"]["mean"] == pytest.approx(1 / 40)
    assert s["kvcompress"]["8"]["kept_fraction"] == pytest.approx(1 / 8)
    lo, hi = s["kvcompress"]["8"]["avg"]["ci"]
    assert lo <= 1 / 40 <= hi


def test_a_cut_peer_run_is_read_back_from_its_progress_lines() -> None:
    sub = [{"id": 7, "kind": "niah_single", "length": 1024},
           {"id": 9, "kind": "qa", "length": 1024}]  # fmt: skip
    log = (
        "noise\n"
        "task 1/2 niah_single 1024: snapkv 2x:1/1 4x:0/1 | none 1x:1/1 (3.2s)\n"
        "task 2/2 qa 1024: snapkv 2x:0/1 4x:0/1 | none 1x:1/1 (1.0s)\n"
    )
    runs = q.peer_from_log(log, sub)
    assert runs["snapkv"]["2"] == [{"id": 7, "score": 1.0}, {"id": 9, "score": 0.0}]
    assert runs["none"]["1"] == [{"id": 7, "score": 1.0}, {"id": 9, "score": 1.0}]
    with pytest.raises(ValueError, match="does not match"):
        q.peer_from_log(log, list(reversed(sub)))


def test_method_variants_parse_to_engine_arguments() -> None:
    assert q.parse_method("uniform") == ("uniform", {})
    assert q.parse_method("kvcompress+maxpool_kernel=15+maxpool_metrics=false") == (
        "kvcompress",
        {"maxpool_kernel": 15, "maxpool_metrics": False},
    )
    with pytest.raises(ValueError, match="key=value"):
        q.parse_method("kvcompress+maxpool_kernel")


def test_the_peer_subset_spreads_over_each_cell_of_its_families() -> None:
    kinds = ["niah_single", "qa"]
    tasks = [{"id": i, "kind": kinds[i // 10], "length": 1024} for i in range(20)]
    tasks.append({"id": 20, "kind": "continuation", "length": 1536})
    assert [t["id"] for t in q.peer_subset(tasks, 4, None)] == [0, 2, 5, 7, 10, 12, 15, 17, 20]
    assert [t["id"] for t in q.peer_subset(tasks, 3, {"qa"})] == [10, 13, 16, 20]
    # every sample of the families asked for, and only those
    assert [t["id"] for t in q.peer_subset(tasks, 0, {"qa"})] == [*range(10, 21)]
