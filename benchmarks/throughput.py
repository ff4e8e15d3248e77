"""CPU offline-throughput benchmark: pagedllm against vLLM (CPU) and HF transformers.

For each workload the same random-token prompts (``workloads.random_prompts``) go to

1. **pagedllm**, in this process: ``LLM(model=DIR, dtype=..., seed=...)`` then
   ``llm.generate([{"prompt_token_ids": ids}, ...], SamplingParams(temperature=0.0,
   max_tokens=N, ignore_eos=True), use_tqdm=False)``;
2. **vllm**: ``peers/vllm_cpu.py`` in the vLLM peer venv (``--vllm-python``);
3. **hf**: ``peers/hf_generate.py`` (static batch ``model.generate``) in this interpreter's venv.

Each engine does one warm-up and ``--repeats`` timed runs; the median is reported. Results go to
``benchmarks/results/cpu_throughput_<workload>_<dtype>_<cpu>.json`` (+ ``.png`` chart when
matplotlib imports; ``<cpu>`` the CPU's model name, e.g. ``AMD_EPYC``); raw per-engine outputs
(with generated token ids) and peer logs go to ``benchmarks/results/tmp/``.

Usage::

    .venv/bin/python benchmarks/throughput.py --workload all --engines pagedllm,vllm,hf --repeats 3
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import importlib.metadata
import io
import itertools
import json
import os
import platform
import pstats
import re
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

try:  # `python -m benchmarks.throughput` from the repo root
    from benchmarks.models import MODEL_BUILDERS, count_parameters
    from benchmarks.workloads import model_vocab_size, random_prompts, summarize_runs, write_json
except ImportError:  # `python benchmarks/throughput.py`: this folder is sys.path[0]
    from models import MODEL_BUILDERS, count_parameters
    from workloads import model_vocab_size, random_prompts, summarize_runs, write_json

BENCH_DIR = Path(__file__).resolve().parent

ENGINES = ("pagedllm", "vllm", "hf")
DEFAULT_VLLM_PYTHON = "/work/peers/vllm/bin/python"
RESULTS_DIR = BENCH_DIR / "results"
#: Fields copied from each engine's raw result into the summary JSON.
SUMMARY_FIELDS = (
    "output_tok_s",
    "total_tok_s",
    "req_s",
    "elapsed_s",
    "startup_s",
    "warmup_s",
    "input_tokens",
    "output_tokens",
    "runs",
)
RATIO_FIELDS = ("output_tok_s", "total_tok_s", "req_s")


@dataclass(frozen=True)
class Workload:
    """One benchmark workload: which model, how many prompts, how long in and out."""

    name: str
    model: str
    num_prompts: int
    input_len: int
    output_len: int
    range_ratio: float = 0.0


WORKLOADS: dict[str, Workload] = {
    "tiny": Workload("tiny", "tiny", num_prompts=64, input_len=128, output_len=64),
    "smollm2": Workload("smollm2", "smollm2", num_prompts=64, input_len=256, output_len=128),
}


# --------------------------------------------------------------------------------------------
# Environment description
# --------------------------------------------------------------------------------------------


def device_info() -> dict[str, Any]:
    """CPU model, core counts and memory of this machine."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
    }
    if hasattr(os, "sched_getaffinity"):
        info["cpus_usable"] = len(os.sched_getaffinity(0))
    try:
        text = Path("/proc/cpuinfo").read_text()
        for line in text.splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and "cpu_model" not in info:
                info["cpu_model"] = value.strip()
            elif key == "flags" and "cpu_flags_simd" not in info:
                flags = value.split()
                info["cpu_flags_simd"] = sorted(
                    f for f in flags if f.startswith(("avx", "amx", "fma", "sse4", "f16c"))
                )
    except OSError:
        pass
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                info["mem_total_gib"] = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return info


def _dist_version(name: str) -> str | None:
    """Installed version of a distribution in this interpreter, or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def peer_version(python: str, dist: str) -> str | None:
    """Version of ``dist`` installed for another interpreter (without importing it)."""
    if not Path(python).exists():
        return None
    code = f"import importlib.metadata as m; print(m.version({dist!r}))"
    try:
        out = subprocess.run(
            [python, "-c", code], capture_output=True, text=True, timeout=60, check=True
        )
    except (subprocess.SubprocessError, OSError):
        return None
    return out.stdout.strip() or None


def versions(vllm_python: str) -> dict[str, Any]:
    """Versions of the libraries involved."""
    return {
        "pagedllm": _dist_version("pagedllm"),
        "torch": _dist_version("torch"),
        "transformers": _dist_version("transformers"),
        "numpy": _dist_version("numpy"),
        "vllm": peer_version(vllm_python, "vllm-cpu") or peer_version(vllm_python, "vllm"),
        "vllm_venv_torch": peer_version(vllm_python, "torch"),
        "vllm_venv_transformers": peer_version(vllm_python, "transformers"),
    }


# --------------------------------------------------------------------------------------------
# Engines
# --------------------------------------------------------------------------------------------


def run_pagedllm(
    model_dir: Path,
    prompts: list[list[int]],
    output_len: int,
    *,
    dtype: str,
    seed: int,
    repeats: int,
    extra_kwargs: dict[str, Any],
    profile_txt: Path | None = None,
) -> dict[str, Any]:
    """Run the workload on pagedllm in this process: warm-up, ``repeats`` timed runs.

    With ``profile_txt``, one more (untimed) run goes under cProfile and the 30 entries with the
    largest cumulative time are written there (raw stats: ``tmp/<same name>.prof``).
    """
    repo_root = str(BENCH_DIR.parent)  # measure this checkout, installed or not
    if repo_root not in sys.path:
        sys.path.insert(0, repo_root)
    import pagedllm
    from pagedllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=str(model_dir), dtype=dtype, seed=seed, **extra_kwargs)
    startup_s = time.perf_counter() - t0

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    requests = [{"prompt_token_ids": ids} for ids in prompts]

    def run_once() -> tuple[float, list[list[int]]]:
        start = time.perf_counter()
        outs = llm.generate(requests, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        return elapsed, [list(o.outputs[0].token_ids) for o in outs]

    warmup_s, token_ids = run_once()
    times: list[float] = []
    for _ in range(repeats):
        elapsed, ids = run_once()
        times.append(elapsed)
        if ids != token_ids:
            print("warning: pagedllm greedy output changed between runs", file=sys.stderr)
        token_ids = ids

    if profile_txt is not None:
        profiler = cProfile.Profile()
        profiler.enable()
        run_once()
        profiler.disable()
        profile_txt.parent.mkdir(parents=True, exist_ok=True)
        prof = profile_txt.parent / "tmp" / profile_txt.with_suffix(".prof").name
        prof.parent.mkdir(parents=True, exist_ok=True)
        profiler.dump_stats(str(prof))
        buf = io.StringIO()
        stats = pstats.Stats(profiler, stream=buf)
        stats.sort_stats("cumulative").print_stats(30)
        header = (
            f"pagedllm generate under cProfile: {len(prompts)} prompts x "
            f"{sum(len(p) for p in prompts) / max(1, len(prompts)):.0f} tokens in, "
            f"{output_len} out, {dtype}, model {model_dir}\n"
        )
        profile_txt.write_text(header + buf.getvalue())
        print(f"pagedllm profile -> {profile_txt}")

    result = {
        "engine": "pagedllm",
        "model": str(model_dir),
        "num_prompts": len(prompts),
        "dtype": dtype,
        "seed": seed,
        "repeats": repeats,
        "llm_kwargs": extra_kwargs,
        "startup_s": startup_s,
        "warmup_s": warmup_s,
        **summarize_runs(
            times, len(prompts), sum(len(p) for p in prompts), sum(len(t) for t in token_ids)
        ),
        "versions": {"pagedllm": getattr(pagedllm, "__version__", _dist_version("pagedllm"))},
        "token_ids": token_ids,
    }
    shutdown = getattr(llm, "shutdown", None)
    if callable(shutdown):
        shutdown()
    return result


def run_peer(
    engine: str,
    python: str,
    script: Path,
    model_dir: Path,
    wl: Workload,
    *,
    dtype: str,
    seed: int,
    repeats: int,
    out_json: Path,
    log_path: Path,
    timeout_s: float,
    extra_args: list[str],
) -> dict[str, Any]:
    """Run a peer script in a subprocess and return its result JSON (log kept in ``log_path``)."""
    if not Path(python).exists():
        raise FileNotFoundError(f"{engine}: interpreter {python} not found (see README)")
    cmd = [
        python,
        str(script),
        "--model",
        str(model_dir),
        "--num-prompts",
        str(wl.num_prompts),
        "--input-len",
        str(wl.input_len),
        "--output-len",
        str(wl.output_len),
        "--range-ratio",
        str(wl.range_ratio),
        "--dtype",
        dtype,
        "--seed",
        str(seed),
        "--repeats",
        str(repeats),
        "--out",
        str(out_json),
        *extra_args,
    ]
    env = dict(os.environ)
    if engine == "vllm":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    out_json.unlink(missing_ok=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"{engine}: running {' '.join(cmd)} (log: {log_path})", flush=True)
    with log_path.open("w") as log:
        proc = subprocess.run(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout_s, check=False
        )
    if proc.returncode != 0 or not out_json.is_file():
        tail = "".join(log_path.read_text(errors="replace").splitlines(keepends=True)[-20:])
        raise RuntimeError(f"{engine} exited with {proc.returncode}; log tail:\n{tail}")
    result: dict[str, Any] = json.loads(out_json.read_text())
    return result


# --------------------------------------------------------------------------------------------
# Comparison and reporting
# --------------------------------------------------------------------------------------------


def compare_tokens(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    """How far two engines' generated token ids agree (position by position, per request)."""
    total = equal = identical = 0
    first_div: list[int] = []
    for x, y in zip(a, b, strict=False):
        n = max(len(x), len(y))
        same = sum(1 for i, j in zip(x, y, strict=False) if i == j)
        total += n
        equal += same
        if x == y:
            identical += 1
        else:
            first_div.append(
                next(
                    (k for k, (i, j) in enumerate(zip(x, y, strict=False)) if i != j),
                    min(len(x), len(y)),
                )
            )
    return {
        "token_match": equal / total if total else None,
        "sequences_identical": identical / len(a) if a else None,
        "num_sequences": len(a),
        "num_sequences_compared": min(len(a), len(b)),
        "mean_first_divergence": sum(first_div) / len(first_div) if first_div else None,
    }


def summarize(
    wl: Workload,
    model_dir: Path,
    raw: dict[str, dict[str, Any]],
    errors: dict[str, str],
    vllm_python: str,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Assemble the summary JSON for one workload from the engines' raw results."""
    engines: dict[str, Any] = {}
    for name, res in raw.items():
        engines[name] = {k: res[k] for k in SUMMARY_FIELDS if k in res}
        for k in ("prefix_caching", "threads", "llm_kwargs", "env", "versions"):
            if k in res:
                engines[name][k] = res[k]
    ratios: dict[str, Any] = {}
    if "pagedllm" in raw:
        for peer in ("vllm", "hf"):
            if peer in raw:
                ratios[f"pagedllm/{peer}"] = {
                    f: raw["pagedllm"][f] / raw[peer][f] for f in RATIO_FIELDS if raw[peer][f]
                }
    agreement = {
        f"{a}~{b}": compare_tokens(raw[a]["token_ids"], raw[b]["token_ids"])
        for a, b in itertools.combinations(list(raw), 2)
    }
    return {
        "benchmark": "cpu_throughput",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "device": device_info(),
        "versions": versions(vllm_python),
        "workload": {**asdict(wl), "dtype": args.dtype, "seed": args.seed, "repeats": args.repeats},
        "model_dir": str(model_dir),
        "model": count_parameters(model_dir),
        "engines": engines,
        "ratios": ratios,
        "token_agreement": agreement,
        "errors": errors,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }


def write_chart(summary: dict[str, Any], png: Path) -> bool:
    """Bar chart of output tok/s (and start-up s) per engine; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    engines = summary["engines"]
    if not engines:
        return False
    names = list(engines)
    colors = {"pagedllm": "#1f77b4", "vllm": "#ff7f0e", "hf": "#2ca02c"}
    wl = summary["workload"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), gridspec_kw={"width_ratios": [2, 1]})
    panels = (("output_tok_s", "output tokens / s (median)"), ("startup_s", "start-up (s)"))
    for ax, (field, label) in zip(axes, panels, strict=True):
        values = [float(engines[n].get(field) or 0.0) for n in names]
        bars = ax.bar(names, values, color=[colors.get(n, "#7f7f7f") for n in names])
        ax.bar_label(bars, labels=[f"{v:,.1f}" for v in values], padding=2, fontsize=9)
        ax.set_ylabel(label)
        ax.margins(y=0.15)
    ratio_txt = ", ".join(
        f"{k} = {v['output_tok_s']:.2f}x" for k, v in summary["ratios"].items() if v
    )
    cpu = summary["device"].get("cpu_model", "CPU")
    fig.suptitle(
        f"{wl['name']}: {wl['num_prompts']} prompts x {wl['input_len']} in, "
        f"{wl['output_len']} out, {wl['dtype']}, greedy\n{cpu}, "
        f"{summary['device'].get('cpus_usable', summary['device'].get('cpu_count'))} cores"
        + (f"   [{ratio_txt}]" if ratio_txt else ""),
        fontsize=10,
    )
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line arguments of the driver."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="all", choices=[*WORKLOADS, "all"])
    p.add_argument(
        "--engines", default=",".join(ENGINES), help="comma list of " + ",".join(ENGINES)
    )
    p.add_argument("--repeats", type=int, default=3, help="timed runs after one warm-up")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    p.add_argument("--hf-python", default=sys.executable)
    p.add_argument("--hf-threads", type=int, default=2)
    p.add_argument(
        "--prefix-caching",
        "--vllm-prefix-caching",
        dest="prefix_caching",
        action="store_true",
        help="prefix caching on in pagedllm and vLLM (default: off in both - the timed runs "
        "repeat the warm-up's prompts, so a prefix cache would skip their prefill)",
    )
    p.add_argument(
        "--pagedllm-kwargs",
        default="{}",
        help="JSON dict of extra keyword arguments for pagedllm.LLM, e.g. '{\"max_num_seqs\": 64}'",
    )
    p.add_argument(
        "--cache-dir", default=None, help="model cache (default ~/.cache/pagedllm-bench)"
    )
    p.add_argument("--results-dir", default=str(RESULTS_DIR))
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per peer subprocess")
    p.add_argument("--profile", action="store_true", help="one extra pagedllm run under cProfile")
    p.add_argument("--num-prompts", type=int, default=None, help="override (smoke tests)")
    p.add_argument("--input-len", type=int, default=None, help="override (smoke tests)")
    p.add_argument("--output-len", type=int, default=None, help="override (smoke tests)")
    args = p.parse_args(argv)
    args.engine_list = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = set(args.engine_list) - set(ENGINES)
    if unknown:
        p.error(f"unknown engines: {sorted(unknown)}")
    return args


def resolve_workload(name: str, args: argparse.Namespace) -> tuple[Workload, str]:
    """The workload with any size overrides applied, and the file stem for its results."""
    wl = WORKLOADS[name]
    changes = {
        k: v
        for k, v in (
            ("num_prompts", args.num_prompts),
            ("input_len", args.input_len),
            ("output_len", args.output_len),
        )
        if v is not None and v != getattr(wl, k)
    }
    stem = f"cpu_throughput_{name}"
    if changes:
        wl = Workload(**{**asdict(wl), **changes})
        stem += f"_n{wl.num_prompts}_in{wl.input_len}_out{wl.output_len}"
    cpu = re.sub(r"\((R|TM)\)", "", device_info().get("cpu_model", "cpu"))  # "Intel(R) Xeon(R)"
    cpu = re.sub(r"[^A-Za-z0-9]+", "_", cpu).strip("_")
    return wl, f"{stem}_{args.dtype}_{cpu}"


def run_workload(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run every selected engine on one workload and write its JSON (and PNG)."""
    wl, stem = resolve_workload(name, args)
    results_dir = Path(args.results_dir)
    tmp_dir = results_dir / "tmp"
    model_dir = MODEL_BUILDERS[wl.model](args.cache_dir)
    prompts = random_prompts(
        wl.num_prompts, wl.input_len, model_vocab_size(model_dir), args.seed, wl.range_ratio
    )
    print(f"== {stem}: {model_dir}, {wl}", flush=True)

    raw: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    for engine in args.engine_list:
        try:
            if engine == "pagedllm":
                res = run_pagedllm(
                    model_dir,
                    prompts,
                    wl.output_len,
                    dtype=args.dtype,
                    seed=args.seed,
                    repeats=args.repeats,
                    extra_kwargs={"enable_prefix_caching": args.prefix_caching,
                                  **json.loads(args.pagedllm_kwargs)},  # fmt: skip
                    profile_txt=results_dir / f"{stem}_profile.txt" if args.profile else None,
                )
                gc.collect()  # free the engine before the peers run
                write_json(tmp_dir / f"{stem}_pagedllm.json", res)
            elif engine == "vllm":
                res = run_peer(
                    "vllm",
                    args.vllm_python,
                    BENCH_DIR / "peers" / "vllm_cpu.py",
                    model_dir,
                    wl,
                    dtype=args.dtype,
                    seed=args.seed,
                    repeats=args.repeats,
                    out_json=tmp_dir / f"{stem}_vllm.json",
                    log_path=tmp_dir / f"{stem}_vllm.log",
                    timeout_s=args.timeout,
                    extra_args=["--prefix-caching"] if args.prefix_caching else [],
                )
            else:
                res = run_peer(
                    "hf",
                    args.hf_python,
                    BENCH_DIR / "peers" / "hf_generate.py",
                    model_dir,
                    wl,
                    dtype=args.dtype,
                    seed=args.seed,
                    repeats=args.repeats,
                    out_json=tmp_dir / f"{stem}_hf.json",
                    log_path=tmp_dir / f"{stem}_hf.log",
                    timeout_s=args.timeout,
                    extra_args=["--threads", str(args.hf_threads)],
                )
        except Exception as exc:  # noqa: BLE001 - one engine failing must not lose the others
            errors[engine] = f"{type(exc).__name__}: {exc}"
            print(f"{engine}: FAILED\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            continue
        raw[engine] = res
        print(
            f"{engine}: {res['output_tok_s']:.1f} output tok/s, {res['total_tok_s']:.1f} total "
            f"tok/s, {res['req_s']:.2f} req/s, start-up {res['startup_s']:.1f} s",
            flush=True,
        )

    summary = summarize(wl, model_dir, raw, errors, args.vllm_python, args)
    out = results_dir / f"{stem}.json"
    write_json(out, summary)
    print(f"-> {out}")
    for key, ratio in summary["ratios"].items():
        print(f"   {key}: " + ", ".join(f"{f} {v:.3f}" for f, v in ratio.items()))
    for key, agree in summary["token_agreement"].items():
        print(
            f"   tokens {key}: {agree['token_match']:.4f} equal, "
            f"{agree['sequences_identical']:.3f} of sequences identical"
        )
    if write_chart(summary, results_dir / f"{stem}.png"):
        print(f"-> {results_dir / f'{stem}.png'}")
    return summary


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the selected workloads; exit 1 if any engine failed."""
    args = parse_args(argv)
    names = list(WORKLOADS) if args.workload == "all" else [args.workload]
    failed = False
    for name in names:
        summary = run_workload(name, args)
        failed |= bool(summary["errors"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
