"""KV-Compress quality on real weights: RULER-style accuracy and held-out loss against the rate.

For SmolLM2-135M-Instruct and Gemma-3-270M (dequantized HF folders from ``benchmarks/models.py``),
on the same token ids for every method:

- the six RULER-style task families of ``benchmarks/kvc_ruler.py`` (single / multi-key /
  multi-value needles, variable tracking, common-word extraction, a quotation question over
  documents), ``--num`` samples per family and length, plain prompts, greedy; a sample scores
  the fraction of its answers found in the output (RULER's ``string_match_all``);
- teacher-forced loss: a window of held-out text is compressed, then its continuation's mean
  negative log-likelihood per token is measured on the compressed cache (our side: the planner
  of ``benchmarks/kvc_probe.py`` evicts at the context's end, with ``prompt_logprobs``; kvpress:
  compress the context, then feed the continuation);
- rates 2x ... 64x: the KVs kept are 1/rate of the prompt's (the 32-token protected window
  included); every method compresses the whole prompt once after its prefill, scoring with the
  attention of its last 32 queries where it scores at all. Methods: our KV-Compress, uniform per
  head and random eviction (``kvc_method``), the full cache, and the peer kvpress's presses
  (``benchmarks/peers/kvpress_run.py``, run in its own environment: ``--peer-python`` and
  ``--peer-path``, a folder put first on its ``PYTHONPATH``).

Statistics: per method and rate, the mean score of every (task, length) cell, each family's
mean over lengths, the macro average over cells (``avg``) and over the cells the full cache
solves at least half of (``avg_solved``), each with a 95% percentile bootstrap interval
(stratified: samples are resampled within their cell, ``--boot`` resamples, fixed seed); paired
bootstrap intervals of KV-Compress minus every other method at the same rate (a win or a loss is
claimed only when the interval excludes 0); the loss with its interval; the KVs kept over the
KVs of the full cache.

    python benchmarks/kvcompress_quality.py --models smollm2 --num 50 \\
        --out benchmarks/results/kvcompress_quality_smollm2_cpu.json

writes the JSON (tasks' shapes, every run's per-sample records, the summary, the comparisons,
the issue's checks) and a PNG beside it. On a GPU (``--device cuda``) the engine runs in
bfloat16 with large batches; ``--dtype`` overrides.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# run as a script, this folder would come first on the path, where a module of it may shadow a
# package of the same name: the repository root goes there instead
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))

from benchmarks.kvc_ruler import KINDS  # noqa: E402

RATES = [2, 4, 8, 16, 32, 64]
OURS = ["kvcompress", "uniform", "random"]
PRESSES = ["snapkv", "adakv_snapkv"]
WINDOW = 32
LENGTHS = {"smollm2": [1024, 4096, 8000], "gemma3": [1024, 4096, 8192, 16384]}
SOLVED = 0.5  # a cell counts in ``avg_solved`` when the full cache scores at least this


def _model_dir(name: str) -> str:
    from benchmarks import models

    if name == "smollm2":
        return str(models.smollm2_hf_dir())
    if name == "gemma3":
        return str(models.gemma3_270m_hf_dir())
    raise ValueError(f"unknown model {name!r}: smollm2 or gemma3")


def build_tasks(tok: Any, lengths: list[int], args: argparse.Namespace) -> list[dict]:
    """The RULER-style tasks and the continuation windows, numbered."""
    from benchmarks import kvc_ruler
    from benchmarks.kvcompress_tasks import continuation_tasks

    kinds = [k for k in args.kinds.split(",") if k]
    tasks = kvc_ruler.ruler_tasks(tok, lengths, args.num, seed=args.seed, kinds=kinds)
    if args.num_cont:
        tasks += continuation_tasks(tok, args.context_len, args.cont_len, args.num_cont, seed=3)
    for i, t in enumerate(tasks):
        t["id"] = i
    return tasks


def parse_method(spec: str) -> tuple[str, dict[str, Any]]:
    """``"kvcompress+kvc_num_sinks=4+maxpool_kernel=3"`` -> ("kvcompress", engine arguments):
    a method and the engine arguments of a variant of it (integers, floats, true/false, else
    text: ``kvcompress+kv_cache_dtype=fp8``)."""
    name, *pairs = spec.split("+")
    kw: dict[str, Any] = {}
    for pair in pairs:
        key, _, val = pair.partition("=")
        if not key or not val:
            raise ValueError(f"method variant {pair!r} of {spec!r} is not key=value")
        low = val.lower()
        if low in ("true", "false"):
            kw[key] = low == "true"
        else:
            try:
                kw[key] = int(val)
            except ValueError:
                try:
                    kw[key] = float(val)
                except ValueError:
                    kw[key] = val
    return name, kw


def _engine(model_dir: str, method: str | None, max_len: int, args: argparse.Namespace) -> Any:
    from benchmarks.kvc_probe import measured_prefix
    from pagedllm import LLM

    kw: dict[str, Any] = dict(
        dtype=args.dtype, max_model_len=max_len, enable_prefix_caching=False, device=args.device
    )
    if args.device == "cpu":
        kw.update(max_num_seqs=4, kv_cache_memory_bytes=3 << 30)  # no eviction under pressure
    else:
        kw.update(max_num_seqs=args.max_num_seqs)
    if method is not None:
        base, variant = parse_method(method)
        kw.update(
            enable_kvc=True,
            kvc_method=base,
            protected_window_size=WINDOW,
            prefill_metric_collection_window_size=WINDOW,
        )
        kw.update(variant)  # a variant's arguments override the defaults above
    with measured_prefix():  # teacher forcing: evict at a prompt token (benchmarks/kvc_probe.py)
        return LLM(model_dir, **kw)


def run_ours(llm: Any, tok: Any, tasks: list[dict], rate: float | None) -> list[dict]:
    """One record per task: score (retrieval) or nll (continuation), kept and full KVs."""
    from benchmarks.kvc_ruler import score
    from pagedllm import SamplingParams

    core = llm.llm_engine.engine_core
    kv = core.scheduler.kv_cache_manager
    probe = None
    if rate is not None:  # the planner (kvc_probe.py; KV-Compress's hooks run last)
        probe = next(c for c in core.scheduler.connectors if c.name == "kvcompress")
    if probe is not None:
        probe.log.clear()
    kvc = {} if rate is None else {"compression_rate": float(rate), "compress_once": True}
    params = []
    for t in tasks:
        if t["kind"] == "continuation":  # teacher forcing, evicted at its context's end
            c = t["context_len"]
            extra = dict(kvc, extra_args={"compress_at": c}) if rate is not None else {}
            params.append(SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, **extra))
        else:
            params.append(SamplingParams(temperature=0.0, max_tokens=t["new_tokens"],
                                         ignore_eos=True, **kvc))  # fmt: skip
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": t["prompt_ids"]} for t in tasks], params,
                        use_tqdm=False)  # fmt: skip
    seconds = time.perf_counter() - t0
    kept: dict[str, int] = {}
    for rid, _, after in probe.log if probe is not None else []:
        kept.setdefault(rid, after)  # compress_once: the eviction after the prompt
    heads = int(kv.compressible.sum()) if hasattr(kv, "compressible") else None
    records = []
    for t, o in zip(tasks, outs):
        rec: dict[str, Any] = {"id": t["id"]}
        if t["kind"] == "continuation":
            lps = [next(iter(d.values())).logprob for d in o.prompt_logprobs[t["context_len"] :]]
            rec["nll"] = -sum(lps) / len(lps)
            full_len = t["context_len"]
        else:
            text = tok.decode(list(o.outputs[0].token_ids), skip_special_tokens=True)
            rec.update(score=score(text, t["answers"]), output=text)
            full_len = len(t["prompt_ids"])
        rec["full_kvs"] = full_len * heads if heads else None
        rec["kept_kvs"] = kept.get(o.request_id, rec["full_kvs"])
        records.append(rec)
    print(f"  ours rate {rate}: {len(tasks)} tasks in {seconds:.1f} s", flush=True)
    return records


def peer_subset(tasks: list[dict], num: int, kinds: set[str] | None) -> list[dict]:
    """The tasks the peer runs: of every cell (of ``kinds``, all when None) ``num`` samples
    spread evenly over its depths (all of them when ``num`` is 0), and every continuation
    window."""
    by_id = {t["id"]: t for t in tasks}
    out = []
    for cell_ids in _cells(tasks).values():
        if kinds is not None and by_id[cell_ids[0]]["kind"] not in kinds:
            continue
        n = min(num, len(cell_ids)) if num else len(cell_ids)
        out += [by_id[cell_ids[int(i * len(cell_ids) / n)]] for i in range(n)]
    return out + [t for t in tasks if t["kind"] == "continuation"]


def run_peer(tasks_path: str, model_dir: str, rates: list[int], args: argparse.Namespace) -> dict:
    """kvpress in its own environment, every press in one process (one prefill per task)."""
    presses = [p for p in args.presses.split(",") if p]
    out = tempfile.mktemp(suffix="_{press}.json")
    cmd = [args.peer_python, str(ROOT / "benchmarks/peers/kvpress_run.py"), "--model", model_dir,
           "--tasks", tasks_path, "--press", ",".join([*presses, "none"]), "--ratios",
           ",".join(map(str, rates)), "--window", str(WINDOW), "--out", out,
           "--device", args.device, "--dtype", args.dtype]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if args.peer_path:
        env["PYTHONPATH"] = args.peer_path
    subprocess.run(cmd, check=True, env=env)
    raw = {}
    for p in [*presses, "none"]:
        path = Path(out.replace("{press}", p))
        if path.is_file():  # a press that failed to run leaves no file (its log says why)
            raw[p] = json.loads(path.read_text())
    return raw


def peer_runs(raw: dict, tok: Any, tasks: list[dict]) -> dict[str, list[dict]]:
    """A press's records in our per-rate layout, scored like ours (same tokenizer, same rule)."""
    from benchmarks.kvc_ruler import score

    by_id = {t["id"]: t for t in tasks}
    out: dict[str, list[dict]] = {}
    for rec in raw["results"]:
        rate = str(int(rec["rate"])) if rec.get("rate") not in (None, 1) else "1"
        t = by_id[rec["id"]]
        row = {"id": rec["id"], "kept_kvs": rec.get("kept_kvs"), "full_kvs": rec.get("full_kvs")}
        if t["kind"] == "continuation":
            row["nll"] = rec["nll"]
        else:
            ids = rec.get("output_ids")
            text = tok.decode(ids, skip_special_tokens=True) if ids else rec.get("output", "")
            row.update(score=score(text, t["answers"]), output=text)
        out.setdefault(rate, []).append(row)
    return out


def peer_from_log(log: str, sub: list[dict]) -> dict[str, dict[str, list[dict]]]:
    """Scores of a peer run cut before it wrote its files, read from its progress lines
    (``task N/M KIND LENGTH: PRESS 2x:a/b 4x:a/b ... | PRESS ...``, ``a`` of ``b`` answers
    found; ``sub`` the task list it was given, in order). Continuation lines carry no records."""
    import re

    runs: dict[str, dict[str, list[dict]]] = {}
    for line in log.splitlines():
        m = re.match(r"task (\d+)/(\d+) (\S+) (\d+): (.*) \([\d.]+s\)$", line.strip())
        if not m:
            continue
        t = sub[int(m.group(1)) - 1]
        if (t["kind"], t["length"]) != (m.group(3), int(m.group(4))) or len(sub) != int(m.group(2)):
            raise ValueError(f"progress line {line[:60]!r} does not match the task list")
        if t["kind"] == "continuation":
            continue
        for part in m.group(5).split(" | "):
            press, *marks = part.split()
            for mark in marks:
                rate, _, frac = mark.partition("x:")
                a, _, b = frac.partition("/")
                runs.setdefault(press, {}).setdefault(rate, []).append(
                    {"id": t["id"], "score": int(a) / int(b)}
                )
    return runs


# ---- statistics ---------------------------------------------------------------------------


def _cells(tasks: list[dict]) -> dict[str, list[int]]:
    """Task ids per retrieval cell ``"kind@length"``, in id order."""
    cells: dict[str, list[int]] = {}
    for t in tasks:
        if t["kind"] != "continuation":
            cells.setdefault(f"{t['kind']}@{t['length']}", []).append(t["id"])
    return cells


def _boot_idx(n: int, reps: int, seed: int) -> Any:
    import numpy as np

    return np.random.default_rng(seed).integers(0, n, size=(reps, n))  # [reps, n]


def _interval(samples: Any) -> list[float]:
    import numpy as np

    return [float(np.percentile(samples, 2.5)), float(np.percentile(samples, 97.5))]


def restrict(tasks: list[dict], runs: dict, ids: set[int]) -> tuple[list[dict], dict]:
    """The tasks with these ids, and every run's records of them (runs lacking one dropped)."""
    sub = [t for t in tasks if t["id"] in ids]
    out = {}
    for method, by_rate in runs.items():
        kept = {r: [x for x in recs if x["id"] in ids] for r, recs in by_rate.items()}
        if all(len(v) == len(sub) for v in kept.values()):
            out[method] = kept
    return sub, out


def summarize(tasks: list[dict], runs: dict, reps: int, seed: int = 0) -> dict:
    """Per method and rate: cell means, family means, macro averages and the loss, with 95%
    stratified bootstrap intervals; the KVs kept over the full cache's. Every run covers every
    task (``restrict`` first where a run covers a subset)."""
    import numpy as np

    cells = _cells(tasks)
    cont = [t["id"] for t in tasks if t["kind"] == "continuation"]
    full = {r["id"]: r for r in runs["full"]["1"]}
    solved = [c for c, ids in cells.items() if np.mean([full[i]["score"] for i in ids]) >= SOLVED]
    out: dict[str, dict] = {}
    for method, by_rate in runs.items():
        out[method] = {}
        for rate, recs in by_rate.items():
            by_id = {r["id"]: r for r in recs}
            row: dict[str, Any] = {"cells": {}}
            boot: dict[str, Any] = {}
            for ci, (cell, ids) in enumerate(cells.items()):
                s = np.array([by_id[i]["score"] for i in ids], dtype=float)  # [n]
                b = s[_boot_idx(len(s), reps, seed + ci)].mean(1)  # [reps]
                boot[cell] = b
                row["cells"][cell] = {"mean": float(s.mean()), "ci": _interval(b), "n": len(s)}
            kinds = sorted({c.split("@")[0] for c in cells})
            row["kinds"] = {}
            for k in kinds:
                ks = [c for c in cells if c.split("@")[0] == k]
                b = np.mean([boot[c] for c in ks], axis=0)
                m = float(np.mean([row["cells"][c]["mean"] for c in ks]))
                row["kinds"][k] = {"mean": m, "ci": _interval(b)}
            for name, use in (("avg", list(cells)), ("avg_solved", solved)):
                if use:
                    b = np.mean([boot[c] for c in use], axis=0)
                    m = float(np.mean([row["cells"][c]["mean"] for c in use]))
                    row[name] = {"mean": m, "ci": _interval(b), "cells": len(use)}
            if cont and all(i in by_id for i in cont):
                nll = np.array([by_id[i]["nll"] for i in cont])
                b = nll[_boot_idx(len(nll), reps, seed + 999)].mean(1)
                row["nll"] = {"mean": float(nll.mean()), "ci": _interval(b), "n": len(nll)}
            kept = [r["kept_kvs"] for r in recs if r.get("kept_kvs") is not None]
            fullk = [r["full_kvs"] for r in recs if r.get("full_kvs") is not None]
            if kept and fullk:
                row["kept_fraction"] = sum(kept) / sum(fullk)
            out[method][rate] = row
    return {"solved_cells": solved, "methods": out}


def compare(tasks: list[dict], runs: dict, ref: str, reps: int, seed: int = 0) -> dict:
    """``ref`` minus every other method at each shared rate: the macro-average difference and
    its paired stratified bootstrap interval (same samples resampled for both), and the loss
    difference; ``verdict`` is win / loss / tie by whether the interval excludes 0."""
    import numpy as np

    cells = _cells(tasks)
    cont = [t["id"] for t in tasks if t["kind"] == "continuation"]
    res: dict[str, dict] = {}
    for other, by_rate in runs.items():
        if other == ref:
            continue
        res[other] = {}
        for rate in runs[ref]:
            mine_recs = runs[ref][rate]
            theirs_recs = by_rate.get(rate) or (by_rate.get("1") if other in ("full", "none")
                                                else None)  # fmt: skip
            if not theirs_recs:
                continue
            a = {r["id"]: r for r in mine_recs}
            b = {r["id"]: r for r in theirs_recs}
            diffs, means = [], []
            for ci, ids in enumerate(cells.values()):
                d = np.array([a[i]["score"] - b[i]["score"] for i in ids])  # [n]
                diffs.append(d[_boot_idx(len(d), reps, seed + ci)].mean(1))
                means.append(d.mean())
            boot = np.mean(diffs, axis=0)
            lo, hi = _interval(boot)
            entry: dict[str, Any] = {
                "avg_diff": float(np.mean(means)),
                "ci": [lo, hi],
                "verdict": "win" if lo > 0 else "loss" if hi < 0 else "tie",
            }
            if cont and all(i in a and i in b and "nll" in b[i] for i in cont):
                d = np.array([a[i]["nll"] - b[i]["nll"] for i in cont])
                bb = d[_boot_idx(len(d), reps, seed + 999)].mean(1)
                entry["nll_diff"] = float(d.mean())
                entry["nll_ci"] = _interval(bb)
            res[other][rate] = entry
    return res


def checks(summary: dict, comparison: dict) -> dict:
    """The issue's goals: KV-Compress >= 90% of the full cache's average at 8x; >= every kvpress
    press at every rate outside the intervals where the press claims a win (no "loss"); >=
    uniform per head at every rate (no "loss")."""
    ms = summary["methods"]
    full = ms["full"]["1"]["avg"]["mean"]
    ours = ms["kvcompress"]
    res: dict[str, Any] = {"full_avg": full}
    if "8" in ours:
        res["kvc_avg_8x"] = ours["8"]["avg"]["mean"]
        res["kvc_8x_ge_90pct_full"] = ours["8"]["avg"]["mean"] >= 0.9 * full
    for other, by_rate in comparison.items():
        if other in ("full", "none", "random"):
            continue
        losses = [r for r, e in by_rate.items() if e["verdict"] == "loss"]
        wins = [r for r, e in by_rate.items() if e["verdict"] == "win"]
        res[f"vs_{other}"] = {"losses_at": losses, "wins_at": wins, "ok": not losses}
    return res


def plot(title: str, summary: dict, path: Path) -> None:
    """Average accuracy and loss against the rate (with intervals), and one panel per family."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms = summary["methods"]
    kinds = list(ms["full"]["1"]["kinds"])
    panels = ["avg", "avg_solved", "nll", *kinds]
    cols = 4
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    for ax, key in zip(axes.flat, panels):

        def get(row: dict, key: str = key) -> dict | None:
            return row["kinds"].get(key) if key in kinds else row.get(key)

        for method, by_rate in ms.items():
            if "1" in by_rate and len(by_rate) == 1:  # the full cache
                e = get(by_rate["1"])
                if e:
                    ax.axhline(e["mean"], color="k" if method == "full" else "grey", ls="--",
                               lw=1, label=f"{method} cache")  # fmt: skip
                    ax.axhspan(*e["ci"], color="k" if method == "full" else "grey", alpha=0.08)
                continue
            xs = sorted(int(r) for r in by_rate if get(by_rate[r]))
            if not xs:
                continue
            es = [get(by_rate[str(x)]) for x in xs]
            ys = [e["mean"] for e in es]
            err = [[y - e["ci"][0] for y, e in zip(ys, es)],
                   [e["ci"][1] - y for y, e in zip(ys, es)]]  # fmt: skip
            ax.errorbar(xs, ys, yerr=err, marker="o", ms=3, capsize=2, label=method,
                        lw=2 if method == "kvcompress" else 1)  # fmt: skip
        if key != "nll":
            ax.set_ylim(-0.03, 1.03)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("compression rate")
        ax.set_title(f"{title}: {key}" + (" (nll, lower is better)" if key == "nll"
                                                    else ""), fontsize=9)  # fmt: skip
    axes.flat[0].legend(fontsize=6)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def rebuild(args: argparse.Namespace) -> None:
    """Re-derive a result (``--rebuild RESULT``) with the scores of a peer run that was cut
    before writing its files (``--peer-log``, its progress lines; ``--kinds``, ``--num-cont``,
    ``--peer-num`` and ``--peer-kinds`` as that run had them); the peer's rows are marked
    partial."""
    result = json.loads(Path(args.rebuild).read_text())
    name = result["model"]
    # the tasks' shapes (id, kind, length) in build_tasks' order: their text depends on the
    # Python that built them (the haystack is its pydoc topics), their order and ids do not
    kinds_run = [k for k in args.kinds.split(",") if k]
    tasks = [{"id": 0, "kind": k, "length": n} for k in kinds_run for n in result["lengths"]
             for _ in range(result["num_per_cell"])]  # fmt: skip
    tasks += [{"id": 0, "kind": "continuation", "length": args.context_len}] * args.num_cont
    tasks = [dict(t, id=i) for i, t in enumerate(tasks)]
    if len(tasks) != result["num_tasks"]:
        raise ValueError(f"{len(tasks)} task shapes for a run of {result['num_tasks']} tasks")
    kinds = set(args.peer_kinds.split(",")) if args.peer_kinds else None
    sub = peer_subset(tasks, args.peer_num, kinds)
    peer = peer_from_log(Path(args.peer_log).read_text(), sub)
    runs = {m: r for m, r in result["runs"].items() if m not in result.get("peer", {})}
    done = sorted({r["id"] for recs in next(iter(peer.values())).values() for r in recs})
    runs.update(peer)
    peer_meta = {
        p: {"source": "progress log (run cut at the call's limit)", "task_ids": done,
            "tasks_done": len(done), "tasks_given": len(sub)}
        for p in peer
    }  # fmt: skip
    sub_tasks, sub_runs = restrict(tasks, runs, set(done))
    ours = {m: r for m, r in runs.items() if m not in peer}
    comparison = compare(tasks, ours, "kvcompress", args.boot)
    on_peer = compare(sub_tasks, sub_runs, "kvcompress", args.boot)
    comparison.update({p: on_peer[p] for p in peer})
    result.update(
        peer=peer_meta,
        runs=runs,
        summary_peer_tasks=summarize(sub_tasks, sub_runs, args.boot),
        comparison_vs_kvcompress=comparison,
        comparison_on_peer_tasks=on_peer,
    )
    result["checks"] = checks(result["summary"], result["comparison_vs_kvcompress"])
    out = Path(args.out.replace("{model}", name))
    out.write_text(json.dumps(result, indent=1, default=str))
    plot(name, result["summary"], out.with_suffix(".png"))
    plot(f"{name} (kvpress's tasks)", result["summary_peer_tasks"],
         out.with_name(out.stem + "_peers.png"))  # fmt: skip
    print(json.dumps(result["checks"]))
    print("wrote", out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--num", type=int, default=50, help="samples per task family and length")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--lengths", default="", help="prompt lengths (default per model)")
    ap.add_argument("--num-cont", type=int, default=16, help="held-out windows for the loss")
    ap.add_argument("--context-len", type=int, default=1536)
    ap.add_argument("--cont-len", type=int, default=128)
    ap.add_argument("--rates", default=",".join(map(str, RATES)))
    ap.add_argument("--methods", default=",".join(OURS), help="our methods to run")
    ap.add_argument("--presses", default=",".join(PRESSES), help="kvpress presses")
    ap.add_argument("--peer-python", default="/tmp/kvpress_venv/bin/python")
    ap.add_argument("--peer-path", default="", help="PYTHONPATH first entry for the peer")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--peer-num", type=int, default=0, help="peer samples per cell (0: all)")
    ap.add_argument("--peer-kinds", default="", help="task families the peer runs (all)")
    ap.add_argument("--state", default="", help="folder keeping finished runs (resume)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="", help="default: float32 on cpu, bfloat16 on cuda")
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    ap.add_argument("--boot", type=int, default=2000, help="bootstrap resamples")
    ap.add_argument("--seed", type=int, default=0, help="task generation seed")
    ap.add_argument("--out", default="benchmarks/results/kvcompress_quality_{model}_cpu.json")
    ap.add_argument("--rebuild", default="", help="a result to re-derive with --peer-log")
    ap.add_argument("--peer-log", default="", help="a cut peer run's progress lines")
    args = ap.parse_args()
    if args.rebuild:
        rebuild(args)
        return
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    rates = [int(r) for r in args.rates.split(",")]
    import torch
    from transformers import AutoTokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    device_name = platform.processor() or platform.machine()
    if args.device == "cuda":
        device_name = torch.cuda.get_device_name()
    for name in args.models.split(","):
        model_dir = _model_dir(name)
        tok = AutoTokenizer.from_pretrained(model_dir)
        lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else LENGTHS[name]
        tasks = build_tasks(tok, lengths, args)
        max_len = max(len(t["prompt_ids"]) + t.get("new_tokens", 1) for t in tasks) + 8
        runs: dict[str, dict[str, list[dict]]] = {}
        seconds: dict[str, float] = {}
        # finished runs are kept per model, method and task set (a hash of the task ids)
        key = hashlib.sha256(json.dumps([t["prompt_ids"] for t in tasks]).encode()).hexdigest()
        state = Path(args.state) / f"{args.dtype}_{key[:12]}" if args.state else None
        for method in ["full", *[m for m in args.methods.split(",") if m]]:
            saved = state / f"{name}_{method}.json" if state else None
            if saved is not None and saved.is_file():  # an earlier invocation's run
                runs[method], seconds[method] = json.loads(saved.read_text())
                continue
            t0 = time.perf_counter()
            llm = _engine(model_dir, None if method == "full" else method, max_len, args)
            if method == "full":
                runs[method] = {"1": run_ours(llm, tok, tasks, None)}
            else:
                runs[method] = {str(r): run_ours(llm, tok, tasks, r) for r in rates}
            seconds[method] = time.perf_counter() - t0
            del llm
            if saved is not None:
                saved.parent.mkdir(parents=True, exist_ok=True)
                saved.write_text(json.dumps([runs[method], seconds[method]]))
            print(name, method, "done", flush=True)
        peer_meta = {}
        if not args.no_peer:
            kinds = set(args.peer_kinds.split(",")) if args.peer_kinds else None
            sub = peer_subset(tasks, args.peer_num, kinds)
            with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
                json.dump(sub, f)
            t0 = time.perf_counter()
            raw = run_peer(f.name, model_dir, rates, args)
            seconds["kvpress"] = time.perf_counter() - t0
            for press, data in raw.items():
                runs[press] = peer_runs(data, tok, tasks)
                peer_meta[press] = {k: v for k, v in data.items() if k != "results"}
                peer_meta[press]["task_ids"] = sorted({r["id"] for r in data["results"]})
        ours = {m: r for m, r in runs.items() if m not in peer_meta}
        summary = summarize(tasks, ours, args.boot)
        comparison = compare(tasks, ours, "kvcompress", args.boot) if "kvcompress" in runs else {}
        peer_summary = on_peer = None
        if peer_meta:  # every method on the tasks the peer ran (paired)
            ids = set.intersection(*(set(m["task_ids"]) for m in peer_meta.values()))
            sub_tasks, sub_runs = restrict(tasks, runs, ids)
            peer_summary = summarize(sub_tasks, sub_runs, args.boot)
            if "kvcompress" in runs:
                on_peer = compare(sub_tasks, sub_runs, "kvcompress", args.boot)
                comparison.update({p: on_peer[p] for p in peer_meta})
        result = {
            "benchmark": "kvcompress_quality",
            "model": name,
            "model_dir": os.path.basename(model_dir),
            "device": device_name,
            "dtype": args.dtype,
            "torch": torch.__version__,
            "window": WINDOW,
            "rates": rates,
            "lengths": lengths,
            "num_per_cell": args.num,
            "num_tasks": len(tasks),
            "task_shapes": sorted({(t["kind"], t["length"], len(t["prompt_ids"])) for t in tasks}),
            "seconds": seconds,
            "summary": summary,
            "summary_peer_tasks": peer_summary,
            "comparison_vs_kvcompress": comparison,
            "comparison_on_peer_tasks": on_peer,
            "checks": checks(summary, comparison) if "kvcompress" in runs else {},
            "peer": peer_meta,
            "runs": runs,
        }
        print(json.dumps(result["checks"]), flush=True)
        out = Path(args.out.replace("{model}", name))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1, default=str))
        plot(result["model"], summary, out.with_suffix(".png"))
        if peer_summary is not None:
            plot(f"{name} (kvpress's tasks)", peer_summary, out.with_name(out.stem + "_peers.png"))
        print("wrote", out, flush=True)


if __name__ == "__main__":
    main()
