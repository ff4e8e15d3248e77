"""KV-Compress quality on real weights (CPU): accuracy and loss against compression rate.

For SmolLM2-135M-Instruct and Gemma-3-270M (dequantized to float32 HF folders by
``benchmarks/models.py``), on the same token ids (``benchmarks/kvcompress_tasks.py``):

- needle-in-a-haystack in real text and passkey retrieval, plain prompts (no chat template),
  greedy, 12 new tokens, correct when the answer appears in them;
- teacher-forced loss: the context is compressed, then the continuation's mean negative
  log-likelihood per token is measured on the compressed cache (the planner of
  ``benchmarks/kvc_probe.py`` evicts at the context's end, with ``prompt_logprobs``; kvpress:
  compress the context, then feed the continuation);
- rates 2x ... 64x (the KVs kept are 1/rate of the prompt's, the protected window of 32 tokens
  included), methods: our KV-Compress, uniform per head, random eviction and the full cache,
  and the peer kvpress (``AdaKVPress(SnapKVPress)`` and ``SnapKVPress``, run in its own venv by
  ``benchmarks/peers/kvpress_run.py``). Both sides compress the whole prompt after its prefill,
  scoring with the attention of its last 32 queries, and report the KVs kept.

    python benchmarks/kvcompress_quality.py --out benchmarks/results/kvcompress_quality_cpu.json

writes the JSON (per task: correct / nll and kept KVs per method and rate; aggregates; the
issue's checks) and a PNG beside it. ``--peer-python`` is the kvpress venv's python
(``benchmarks/peers/kvpress_setup.sh`` makes /tmp/kvpress_venv); ``--no-peer`` skips it.
"""

from __future__ import annotations

import argparse
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
sys.path.insert(0, str(ROOT))

RATES = [2, 4, 8, 16, 32, 64]
OURS = ["kvcompress", "uniform", "random"]
PEERS = ["adakv_snapkv", "snapkv"]
WINDOW = 32
NEW_TOKENS = 12


def _model_dir(name: str) -> str:
    from benchmarks import models

    if name == "smollm2":
        return str(models.smollm2_hf_dir())
    return str(models.gemma3_270m_hf_dir())


def _tasks(name: str, model_dir: str, args: argparse.Namespace) -> list[dict]:
    from transformers import AutoTokenizer

    from benchmarks import kvcompress_tasks as kt

    tok = AutoTokenizer.from_pretrained(model_dir)
    if name == "smollm2":
        needle, passkey = [1024, 2048, 4096], [512, 1024, 2048, 4096]
    else:
        needle, passkey = [1024, 4096, 8192], [1024, 4096, 8192]
    if args.lengths:
        needle = passkey = [int(x) for x in args.lengths.split(",")]
    n = args.num if name == "smollm2" else args.num_gemma
    tasks = kt.needle_tasks(tok, needle, n, seed=1) + kt.passkey_tasks(tok, passkey, n, seed=2)
    tasks += kt.continuation_tasks(tok, args.context_len, args.cont_len, args.num_cont, seed=3)
    for i, t in enumerate(tasks):
        t["id"] = i
    return tasks


def _engine(model_dir: str, method: str | None, max_len: int) -> Any:
    from benchmarks.kvc_probe import measured_prefix
    from pagedllm import LLM

    kw: dict[str, Any] = dict(
        dtype="float32",
        max_model_len=max_len,
        max_num_seqs=4,
        kv_cache_memory_bytes=3 << 30,  # room for every request: no eviction under pressure
        enable_prefix_caching=False,
    )
    if method is not None:
        kw.update(
            enable_kvc=True,
            kvc_method=method,
            protected_window_size=WINDOW,
            prefill_metric_collection_window_size=WINDOW,
        )
    with measured_prefix():  # teacher forcing: evict at a prompt token (benchmarks/kvc_probe.py)
        return LLM(model_dir, **kw)


def _run_ours(llm: Any, tasks: list[dict], rate: float | None) -> list[dict]:
    """One result per task: correct or nll, and the KVs kept by its eviction."""
    from pagedllm import SamplingParams

    core = llm.llm_engine.engine_core
    kv = core.scheduler.kv_cache_manager
    probe = core.scheduler.connectors[0] if rate is not None else None  # (kvc_probe.py)
    if probe is not None:
        probe.log.clear()
    kvc = {} if rate is None else {"compression_rate": float(rate), "compress_once": True}
    retrieval = [t for t in tasks if t["kind"] != "continuation"]
    cont = [t for t in tasks if t["kind"] == "continuation"]
    results: dict[int, dict] = {}
    rid_of: dict[int, str] = {}
    t0 = time.perf_counter()
    if retrieval:
        sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, **kvc)
        outs = llm.generate([{"prompt_token_ids": t["prompt_ids"]} for t in retrieval], sp,
                            use_tqdm=False)  # fmt: skip
        for t, o in zip(retrieval, outs):
            text = o.outputs[0].text
            results[t["id"]] = {"correct": t["answer"] in text, "output": text}
            rid_of[t["id"]] = o.request_id
    for t in cont:  # teacher forcing: one request each, evicted at its context's end
        c = t["context_len"]
        extra = dict(kvc, extra_args={"compress_at": c}) if rate is not None else {}
        sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, **extra)
        o = llm.generate([{"prompt_token_ids": t["prompt_ids"]}], sp, use_tqdm=False)[0]
        lps = [next(iter(d.values())).logprob for d in o.prompt_logprobs[c:]]
        results[t["id"]] = {"nll": -sum(lps) / len(lps)}
        rid_of[t["id"]] = o.request_id
    seconds = time.perf_counter() - t0
    heads = int(kv.compressible.sum()) if hasattr(kv, "compressible") else None
    kept: dict[str, int] = {}
    for rid, _, after in probe.log if probe is not None else []:
        kept.setdefault(rid, after)  # compress_once: the eviction after the prompt
    for t in tasks:
        r = results[t["id"]]
        full_len = t.get("context_len", len(t["prompt_ids"]))
        r["full_kvs"] = full_len * heads if heads else None
        r["kept_kvs"] = kept.get(rid_of[t["id"]], r["full_kvs"])
    for r in results.values():
        r["seconds_run"] = seconds
    return [results[t["id"]] | {"id": t["id"]} for t in tasks]


def _run_peer(
    python: str,
    model_dir: str,
    tasks_path: str,
    presses: list[str],
    rates: list[int],
    threads: int,
) -> dict[str, dict]:
    """kvpress in its venv, every press in one process (one prefill per task, shared)."""
    out = tempfile.mktemp(suffix="_{press}.json")
    cmd = [python, str(ROOT / "benchmarks/peers/kvpress_run.py"), "--model", model_dir,
           "--tasks", tasks_path, "--press", ",".join(presses), "--ratios",
           ",".join(map(str, rates)), "--window", str(WINDOW), "--threads", str(threads),
           "--out", out]  # fmt: skip
    subprocess.run(cmd, check=True, env={k: v for k, v in os.environ.items()
                                         if k != "PYTHONPATH"})  # fmt: skip
    res = {}
    for p in presses:
        with open(out.replace("{press}", p)) as f:
            res[p] = json.load(f)
    return res


def _summary(tasks: list[dict], runs: dict[str, dict[str, list[dict]]]) -> dict:
    """Per method and rate: accuracy by kind (and by kind and length), mean nll, kept KVs."""
    kinds = sorted({t["kind"] for t in tasks})
    out: dict[str, dict] = {}
    for method, by_rate in runs.items():
        out[method] = {}
        for rate, res in by_rate.items():
            row: dict[str, Any] = {}
            for kind in kinds:
                ids = {t["id"] for t in tasks if t["kind"] == kind}
                rs = [r for r in res if r["id"] in ids]
                if kind == "continuation":
                    row["nll"] = sum(r["nll"] for r in rs) / max(1, len(rs))
                    continue
                row[f"{kind}_acc"] = sum(r["correct"] for r in rs) / max(1, len(rs))
                for length in sorted({t["length"] for t in tasks if t["kind"] == kind}):
                    lid = {t["id"] for t in tasks if t["kind"] == kind and t["length"] == length}
                    lr = [r for r in rs if r["id"] in lid]
                    row[f"{kind}_acc_{length}"] = sum(r["correct"] for r in lr) / max(1, len(lr))
            kept = [r.get("kept_kvs") for r in res if r.get("kept_kvs") is not None]
            full = [r.get("full_kvs") for r in res if r.get("full_kvs") is not None]
            row["kept_kvs"] = sum(kept)
            row["full_kvs"] = sum(full)
            out[method][rate] = row
    return out


def _checks(summary: dict) -> dict:
    """The issue's targets, per model: >= 95% of full-cache accuracy at 8x; KV-Compress >=
    uniform and >= kvpress AdaKV at every rate (retrieval accuracy, mean of the kinds)."""

    def acc(row: dict) -> float:
        vals = [v for k, v in row.items() if k.endswith("_acc")]
        return sum(vals) / len(vals) if vals else 0.0

    full = acc(summary["full"]["1"])
    ours = summary["kvcompress"]
    res = {
        "full_acc": full,
        "kvc_acc_8x": acc(ours["8"]),
        "kvc_8x_ge_95pct_full": acc(ours["8"]) >= 0.95 * full,
    }
    if "uniform" in summary:
        res["kvc_ge_uniform_every_rate"] = all(
            acc(ours[r]) >= acc(summary["uniform"][r]) for r in ours if r in summary["uniform"]
        )
    if "adakv_snapkv" in summary:
        peer = summary["adakv_snapkv"]
        res["kvc_ge_adakv_every_rate"] = all(
            acc(ours[r]) >= acc(peer[r]) for r in ours if r in peer
        )
    return res


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(result["models"])
    panels = ["needle_acc", "passkey_acc", "nll"]
    fig, axes = plt.subplots(len(models), 3, figsize=(15, 4 * len(models)), squeeze=False)
    for i, name in enumerate(models):
        summary = result["models"][name]["summary"]
        for j, key in enumerate(panels):
            ax = axes[i][j]
            for method, by_rate in summary.items():
                if method == "full" or method == "none":
                    v = by_rate.get("1", {}).get(key)
                    if v is not None:
                        ax.axhline(v, color="k", ls="--", lw=1, label=f"{method} cache")
                    continue
                xs = [int(r) for r in by_rate if key in by_rate[r]]
                ax.plot(xs, [by_rate[str(x)][key] for x in xs], marker="o", label=method)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("compression rate")
            ax.set_title(f"{name}: {key}")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--num", type=int, default=4, help="retrieval tasks per length")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    ap.add_argument("--methods", default=",".join(OURS), help="our methods to run")
    ap.add_argument("--reuse", default="", help="a .partial.json of the same tasks to resume")
    ap.add_argument("--lengths", default="", help="retrieval prompt lengths (default per model)")
    ap.add_argument("--num-gemma", type=int, default=1, help="Gemma's tasks per length")
    ap.add_argument("--num-cont", type=int, default=4, help="continuation tasks")
    ap.add_argument("--context-len", type=int, default=2048)
    ap.add_argument("--cont-len", type=int, default=128)
    ap.add_argument("--rates", default=",".join(map(str, RATES)))
    ap.add_argument("--peer-python", default="/tmp/kvpress_venv/bin/python")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/kvcompress_quality_cpu.json")
    args = ap.parse_args()
    rates = [int(r) for r in args.rates.split(",")]
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    result: dict[str, Any] = {
        "benchmark": "kvcompress_quality",
        "device": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "window": WINDOW,
        "rates": rates,
        "models": {},
    }
    for name in args.models.split(","):
        model_dir = _model_dir(name)
        tasks = _tasks(name, model_dir, args)
        max_len = max(len(t["prompt_ids"]) for t in tasks) + NEW_TOKENS + 16
        runs: dict[str, dict[str, list[dict]]] = {}
        if args.reuse:  # runs of an interrupted invocation (its .partial.json), same tasks
            runs = json.loads(Path(args.reuse).read_text())["runs"]
        if "full" not in runs:
            llm = _engine(model_dir, None, max_len)
            runs["full"] = {"1": _run_ours(llm, tasks, None)}
            del llm
        for method in [m for m in args.methods.split(",") if m]:
            llm = _engine(model_dir, method, max_len)
            runs.setdefault(method, {})
            for r in rates:
                if str(r) in runs[method]:
                    continue
                runs[method][str(r)] = _run_ours(llm, tasks, r)
                print(name, method, r, "done", flush=True)
                partial = Path(args.out).with_suffix(".partial.json")
                partial.write_text(json.dumps({"runs": runs}, default=str))
            del llm
        peer_raw = {}
        if not args.no_peer:
            with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
                json.dump(tasks, f)
            presses = [*PEERS, "none"]
            peer_raw = _run_peer(args.peer_python, model_dir, f.name, presses, rates,
                                 args.threads or 2)  # fmt: skip
            for press in presses:
                runs[press] = _peer_runs(peer_raw[press], rates)
        summary = _summary(tasks, runs)
        result["models"][name] = {
            "model_dir": os.path.basename(model_dir),
            "num_tasks": len(tasks),
            "task_lengths": sorted({(t["kind"], t["length"]) for t in tasks}),
            "summary": summary,
            "checks": _checks(summary),
            "runs": runs,
            "peer": {
                p: {k: v for k, v in d.items() if k != "results"} for p, d in peer_raw.items()
            },  # fmt: skip
        }
        print(json.dumps(result["models"][name]["checks"]), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    _plot(result, out.with_suffix(".png"))
    print("wrote", out)


def _peer_runs(raw: dict, rates: list[int]) -> dict[str, list[dict]]:
    """The peer's results in our per-rate layout (see benchmarks/peers/kvpress_run.py)."""
    out: dict[str, list[dict]] = {}
    for rec in raw["results"]:
        rate = str(int(rec["rate"])) if rec.get("rate") not in (None, 1) else "1"
        row = {"id": rec["id"], "kept_kvs": rec.get("kept_kvs"), "full_kvs": rec.get("full_kvs")}
        if "correct" in rec:
            row["correct"] = rec["correct"]
            row["output"] = rec.get("output")
        if "nll" in rec:
            row["nll"] = rec["nll"]
        out.setdefault(rate, []).append(row)
    return out


if __name__ == "__main__":
    main()
