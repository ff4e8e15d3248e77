"""Server vs in-process engine on one workload, several concurrency caps, in one run.

For each model shape: the same prompts (token ids), arrivals and concurrency caps through
``pagedllm serve`` with the engine core in its own process (the default), through the server
with the engine on a thread (``--no-engine-process``, the old layout), through the engine
in-process (``pagedllm.LLM``, the ceiling), and through the model-free canned server (the
load generator's own ceiling). The model is a built-in shape with random weights and the
vocabulary of the tokenizer in ``PAGEDLLM_TOKENIZER_DIR`` (SmolLM2's, 49,152 ids), so the
server detokenizes real text. Writes ``serving_gpu_<shape>_<device>.json`` and ``.png``.

    PYTHONPATH=. python benchmarks/serving_gpu.py --shape qwen3-0.6b --concurrency 1,64,256
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import shutil
import time
from collections.abc import Callable

from pagedllm.bench import serving as bs
from pagedllm.model.loader import BUILTIN_CONFIGS

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def model_dir(shape: str, tok_dir: str) -> str:
    """A dummy-weight model folder: the shape's config with the tokenizer's vocabulary, and
    the tokenizer's files (so the server loads it from the folder)."""
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(tok_dir)
    path = f"/tmp/serving_{shape}_v{len(tok)}"
    os.makedirs(path, exist_ok=True)
    config = json.load(open(os.path.join(BUILTIN_CONFIGS, shape, "config.json")))
    eos = tok.eos_token_id
    config.update(vocab_size=len(tok), bos_token_id=eos, eos_token_id=eos)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    for name in os.listdir(tok_dir):
        if name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(os.path.join(tok_dir, name), path)
    return path


def bench_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bs.add_arguments(p)
    return p.parse_args(argv)


def prompts_for(conc: int, args: argparse.Namespace) -> int:
    """Enough requests for several waves at this cap (fewer for one at a time)."""
    return max(args.min_prompts, conc * args.waves) if conc > 1 else args.single_prompts


def process_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of the server's processes so far, by role: "front" (the
    HTTP process, ``pagedllm ... serve``) and "core" (the engine core process)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        role = "core" if "pagedllm.engine.core_proc" in cmd else (
            "front" if "pagedllm.entrypoints.cli serve" in cmd else None)  # fmt: skip
        if role:
            out[role] = out.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


# where a first token waits, as the server's histograms see it (``pagedllm.metrics``)
WAITS = {
    "server_ttft": "vllm:time_to_first_token_seconds",
    "handoff": "pagedllm:request_handoff_time_seconds",
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
}


def scrape_waits(url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of each ``WAITS`` histogram on the server at ``url`` (its /v1 base)."""
    import httpx

    text = httpx.get(url.rsplit("/v1", 1)[0] + "/metrics", timeout=30).text
    out: dict[str, tuple[float, float]] = {}
    for key, name in WAITS.items():
        total = count = 0.0
        for line in text.splitlines():
            if line.startswith(name + "_sum"):
                total += float(line.rsplit(" ", 1)[1])
            elif line.startswith(name + "_count"):
                count += float(line.rsplit(" ", 1)[1])
        out[key] = (total, count)
    return out


def mean_waits(before: dict, after: dict) -> dict[str, float | None]:
    """Mean ms of each wait over the requests between two scrapes."""
    out: dict[str, float | None] = {}
    for key in WAITS:
        n = after[key][1] - before[key][1]
        out[key] = 1e3 * (after[key][0] - before[key][0]) / n if n else None
    return out


def triton_kernels() -> int:
    """Kernels in Triton's on-disk cache: a timed run that adds some paid for compiling them."""
    root = os.environ.get("TRITON_CACHE_DIR") or os.path.expanduser("~/.triton/cache")
    return sum(1 for _, _, files in os.walk(root) for f in files if f.endswith(".json"))


def print_loop_stats() -> None:
    """The loop reports (``PAGEDLLM_LOOP_STATS``) of the newest server log."""
    import glob

    logs = sorted(glob.glob("/tmp/pagedllm_serve_*.log"), key=os.path.getmtime)
    if logs:
        for line in open(logs[-1]):
            if " loop, last " in line:
                print("   ", line.strip()[24:], flush=True)


def server_pids() -> dict[str, str]:
    """The running server's processes by role ("front", "core")."""
    pids = {}
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "pagedllm.engine.core_proc" in cmd:
            pids["core"] = pid
        elif "pagedllm.entrypoints.cli serve" in cmd:
            pids["front"] = pid
    return pids


def start_profiles(seconds: float, out_dir: str, tag: str) -> list:
    """py-spy (when installed) sampling each server process for ``seconds``, 2 s into the
    run that follows; ``finish_profiles`` collects them."""
    import subprocess

    if shutil.which("py-spy") is None:
        print("py-spy not installed: no profile", flush=True)
        return []
    procs = []
    for role, pid in server_pids().items():
        path = os.path.join(out_dir, f"pyspy_{tag}_{role}.txt")
        cmd = (
            f"sleep 2; py-spy record -p {pid} -d {seconds:g} -r 100 -f raw -o {path} --nonblocking"
        )
        procs.append((role, path, subprocess.Popen(["sh", "-c", cmd], stdout=subprocess.DEVNULL,
                                                   stderr=subprocess.DEVNULL)))  # fmt: skip
    return procs


def _shares(counts: object, total: int) -> dict[str, float]:
    return {f: round(n / max(1, total), 3) for f, n in counts.most_common(25)}


def finish_profiles(procs: list) -> dict:
    """Each profile's hottest frames: share of samples in the frame itself and under it."""
    from collections import Counter

    out = {}
    for role, path, proc in procs:
        proc.wait()
        own, under, total = Counter(), Counter(), 0
        if not os.path.exists(path):
            continue
        for line in open(path):
            stack, n = line.rsplit(" ", 1)
            frames = stack.split(";")
            total += int(n)
            own[frames[-1]] += int(n)
            for f in set(frames):
                under[f] += int(n)
        out[role] = {
            "samples": total,
            "self": _shares(own, total),
            "inclusive": _shares(under, total),
        }
        print(f"py-spy {role}: {total} samples; hottest (self):", flush=True)
        for f, x in list(out[role]["self"].items())[:12]:
            print(f"   {100 * x:5.1f}% {f[:140]}", flush=True)
    return out


def offline_run(llm: object, a: argparse.Namespace, prompts: list, arrivals: list) -> object:
    return bs.run_offline(a, llm, prompts, arrivals)


def run_shape(shape: str, args: argparse.Namespace, device: str) -> dict:
    path = model_dir(shape, os.environ["PAGEDLLM_TOKENIZER_DIR"])
    common = f"{path} --load-format dummy --dtype {args.dtype} --max-model-len 2048 --seed 0"
    concs = [int(c) for c in args.concurrency.split(",")]
    base = [
        "--prompt-type", "ids", "--input-len", str(args.input_len), "--output-len",
        str(args.output_len), "--max-token-id", "40000", "--client", "raw",
        "--client-processes", str(args.client_processes), "--no-plot", "--warmup", "4",
    ]  # fmt: skip
    workload = {
        "input_len": args.input_len,
        "output_len": args.output_len,
        "concurrency": concs,
        "prompts": {c: prompts_for(c, args) for c in concs},
        "client": f"raw asyncio client, {args.client_processes} processes",
    }
    out: dict = {"shape": shape, "device": device, "host_cpu": host_cpu(),
                 "cpu_count": os.cpu_count(), "workload": workload, "runs": {},
                 "server_stack": server_stack()}  # fmt: skip

    def make(c: int, extra: list[str], warm: bool = False) -> tuple[argparse.Namespace, list, list]:
        n = prompts_for(c, args)
        if warm:  # one wave of short requests: kernels compiled, graphs touched, untimed
            n, extra = max(2, c), [*extra, "--output-len", "16", "--seed", "7"]
        a = bench_args([*base, "--num-prompts", str(n), "--concurrency", str(c), *extra])
        return a, bs.make_prompts(a, a.seed, n), bs.arrival_times(n, a.request_rate, a.seed)

    def warm_up(run: Callable[[argparse.Namespace, list, list], object], extra: list[str]) -> None:
        """Every cap once, short, untimed: the first prefill batches of a shape compile
        Triton kernels (seconds), which must not land in whichever mode runs first."""
        for c in concs:
            run(*make(c, extra, warm=True))

    modes = {"server_process": "", "server_thread": " --no-engine-process",
             "server_api2": " --api-server-count 2", "server_api4": " --api-server-count 4"}
    for mode in args.modes.split(","):
        if mode == "canned":
            from pagedllm.bench import canned_server

            with canned_server.spawned(args.canned_processes) as url:
                warm_up(bs.http_run, ["--base-url", url])
                for c in concs:
                    a, prompts, arrivals = make(c, ["--base-url", url])
                    r = bs.summarize(*bs.http_run(a, prompts, arrivals))
                    out["runs"].setdefault("canned", {})[c] = r
                    print(shape, "canned", c, brief(r), flush=True)
            continue
        if mode == "offline":
            a, _, _ = make(concs[0], ["--server-args", common])
            t0 = time.monotonic()
            llm = bs.build_llm(a)
            out["offline_startup_s"] = time.monotonic() - t0
            warm_up(functools.partial(offline_run, llm), ["--server-args", common])
            for c in concs * args.warm_passes:  # the whole workload, untimed: see --modes
                offline_run(llm, *make(c, ["--server-args", common]))
            for c in concs:
                a, prompts, arrivals = make(c, ["--server-args", common])
                kernels = triton_kernels()
                r = bs.summarize(*bs.run_offline(a, llm, prompts, arrivals))
                r["triton_kernels_compiled"] = triton_kernels() - kernels
                out["runs"].setdefault("offline", {})[c] = r
                print(shape, "offline", c, brief(r), flush=True)
            del llm
            gc.collect()
            continue
        server_args = common + modes[mode]
        a, _, _ = make(concs[0], ["--server-args", server_args])
        t0 = time.monotonic()
        os.environ["PAGEDLLM_LOOP_STATS"] = str(args.loop_stats)  # in the server's log
        with bs.spawned_server(a) as url:
            out[f"{mode}_startup_s"] = time.monotonic() - t0
            warm_up(bs.http_run, ["--base-url", url])
            for c in concs * args.server_warm_passes:  # untimed: see --warm-passes
                bs.http_run(*make(c, ["--base-url", url]))
            for c in concs:
                a, prompts, arrivals = make(c, ["--base-url", url])
                profiles = []
                if args.profile_front and c == concs[-1]:
                    profiles = start_profiles(args.profile_front, args.out, f"{mode}_c{c}")
                waits = scrape_waits(url)
                before, kernels = process_cpu(), triton_kernels()
                r = bs.summarize(*bs.http_run(a, prompts, arrivals))
                after = process_cpu()
                # the first token's wait as the server saw it (mean ms); the client's mean
                # TTFT less server_ttft is HTTP's share (parsing in, the stream out)
                r["waits_ms"] = mean_waits(waits, scrape_waits(url))
                r["triton_kernels_compiled"] = triton_kernels() - kernels
                if profiles:
                    out.setdefault("profiles", {})[f"{mode}_c{c}"] = finish_profiles(profiles)
                # where the time goes: each server process's CPU per second of the run, and
                # per output token (the client's is client_cpu_s)
                r["server_cpu"] = {
                    k: {"cpu_fraction": (after[k] - before.get(k, 0.0)) / r["elapsed_s"],
                        "cpu_us_per_token": 1e6 * (after[k] - before.get(k, 0.0))
                        / max(1, r["total_output_tokens"])}
                    for k in after
                }  # fmt: skip
                out["runs"].setdefault(mode, {})[c] = r
                print(shape, mode, c, brief(r), flush=True)
        print_loop_stats()
    ratios: dict = {}
    offline = out["runs"].get("offline", {})
    for mode, runs in out["runs"].items():
        if mode == "offline":
            continue
        for c, r in runs.items():
            o = offline.get(c)
            if o and o["output_throughput"] and r["output_throughput"]:
                ratios.setdefault(mode, {})[c] = {
                    "throughput_ratio": r["output_throughput"] / o["output_throughput"],
                    "tpot_p50_ratio": (r["tpot_ms"]["p50"] or 0) / (o["tpot_ms"]["p50"] or 1),
                    "ttft_p50_ms": [r["ttft_ms"]["p50"], o["ttft_ms"]["p50"]],
                }
    out["vs_offline"] = ratios
    return out


def server_stack() -> dict[str, str | None]:
    """The versions of the server's event loop and HTTP parser packages (None: missing; then
    uvicorn falls back to asyncio's loop and the pure-Python h11, a slower front end)."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for pkg in ("uvicorn", "uvloop", "httptools", "fastapi"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def host_cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


def brief(r: dict) -> dict:
    cpu = {k: round(v["cpu_fraction"], 2) for k, v in r.get("server_cpu", {}).items()}
    return {"tok/s": round(r["output_throughput"] or 0), "failed": r["failed"],
            "tpot_p50": r["tpot_ms"]["p50"], "ttft_p50": r["ttft_ms"]["p50"],
            "tok/chunk": r.get("mean_tokens_per_chunk"), "cpu": cpu,
            "client_cpu_s": r.get("client_cpu_s"), "waits_ms": r.get("waits_ms"),
            "compiled": r.get("triton_kernels_compiled")}  # fmt: skip


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    concs = result["workload"]["concurrency"]
    modes = list(runs)  # in the order they ran
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    width = 0.8 / max(1, len(modes))
    panels = (("output tokens/s", lambda r: r["output_throughput"]),
              ("TPOT p50 (ms)", lambda r: r["tpot_ms"]["p50"]),
              ("TTFT p50 (ms)", lambda r: r["ttft_ms"]["p50"]))  # fmt: skip
    for i, m in enumerate(modes):
        xs = [j + i * width for j in range(len(concs))]
        for ax, (_, value) in zip(axes, panels):
            ax.bar(xs, [value(runs[m][c]) or 0 for c in concs], width, label=m)
    for ax, (title, _) in zip(axes, panels):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(concs))], [str(c) for c in concs])
        ax.set_xlabel("concurrency")
        ax.set_title(title)
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{result['shape']} on {result['device']}: server vs in-process engine")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--concurrency", default="1,64,256")
    # the in-process engine first: the first engine to meet a batch shape compiles its Triton
    # kernels (seconds), and the later ones find them in the on-disk cache
    p.add_argument("--modes", default="offline,server_process,server_thread,canned")
    p.add_argument(
        "--warm-passes",
        type=int,
        default=1,
        help="untimed passes of the whole workload through the in-process engine "
        "before anything is timed (Triton compiles each new batch shape once)",
    )
    p.add_argument(
        "--server-warm-passes",
        type=int,
        default=1,
        help="untimed passes of the whole workload through each server first",
    )
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--waves", type=int, default=4)
    p.add_argument("--min-prompts", type=int, default=64)
    p.add_argument("--single-prompts", type=int, default=16)
    p.add_argument("--client-processes", type=int, default=4)
    p.add_argument("--canned-processes", type=int, default=4)
    p.add_argument("--loop-stats", type=float, default=5.0, help="loop report interval (s)")
    p.add_argument("--profile-front", type=float, default=0.0, help="py-spy seconds")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    try:
        import torch

        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except ImportError:
        device = "cpu"
    result = run_shape(args.shape, args, device)
    stem = f"serving_gpu_{args.shape}_{device.replace(' ', '_')}"
    os.makedirs(args.out, exist_ok=True)
    for runs in result["runs"].values():  # the summaries; per-request lists stay out
        for r in runs.values():
            r.pop("requests", None)
    with open(os.path.join(args.out, stem + ".json"), "w") as f:
        json.dump(result, f, indent=2)
    plot(result, os.path.join(args.out, stem + ".png"))
    print(json.dumps(result["vs_offline"], indent=1))


if __name__ == "__main__":
    main()
