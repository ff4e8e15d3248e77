"""Huge prompts against a live ``pagedllm serve``: refused fast, without stalling other clients
or growing the server's memory.

Starts ``pagedllm serve`` on loopback (the default model unless ``--model``; ``--server-arg``
passes flags on) or attaches to one (``--url``; then memory is not measured), and sends prompts
far longer than any context as completions ``prompt``, chat ``messages`` content, ``/tokenize``
``prompt`` and ``/tokenize`` ``messages``:

- ``--big-mb`` (20) million characters: the body is over ``--max-request-body-bytes`` (8 MiB
  by default), so the answer must be 413, decided from Content-Length; the same body sent
  chunked (``big-chunked``: no Content-Length, the server reads up to its limit) must be 413
  too;
- ``--under-mb`` (7) million characters: a body under that limit, so the server parses it and
  its length check (more characters than ``max_model_len`` tokens can hold, before
  tokenizing) must answer 400 naming the field.

Each is sent alone (time until its error response is complete: must be under ``--max-error-s``,
1 s), then ``--parallel`` (8) at once for each of the three, while the server's resident memory
(server process + children, ``/proc/PID/status`` VmRSS) is sampled every 50 ms: the peak may
exceed the memory just before by at most ``--max-rss-growth-mb`` (500). Throughout, a separate
process polls ``GET /health`` every 20 ms on a connection of its own: the slowest answer from the
first huge prompt on must stay under ``--max-health-ms`` (100 ms; ``--idle-s`` of idle polls
come first, as the machine's own noise). The very first request (``cold``, 7 MB) goes to a server
that has answered no prompt yet (the per-model character limit is computed then); one small
request per endpoint follows before the other cases.

Bodies are built before anything is timed and sent over raw asyncio connections (no client
library's parsing in the measurement). Writes ``benchmarks/results/huge_prompt_<device>.json``
and a PNG (``--out`` to change) and exits non-zero, saying why, when a bound fails.

    .venv/bin/python benchmarks/huge_prompt.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._live_server import (  # noqa: E402
    LiveServer,
    RssSampler,
    cpu_seconds,
    device_label,
    flag_value,
    git_state,
)

RESULTS = Path(__file__).resolve().parent / "results"
_WORDS = b"lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor ".split()

# (case name, path, the field the prompt goes in, the param a 400 must name)
ENDPOINTS = [
    ("completions.prompt", "/v1/completions", "prompt", "prompt"),
    ("chat.messages", "/v1/chat/completions", "messages", "messages"),
    ("tokenize.prompt", "/tokenize", "prompt", "prompt"),
    ("tokenize.messages", "/tokenize", "messages", "messages"),
]


def text_of(num_chars: int) -> str:
    """``num_chars`` characters of ASCII words (one JSON byte each)."""
    unit = b" ".join(_WORDS[i % len(_WORDS)] for i in range(997)) + b" "
    reps = num_chars // len(unit) + 1
    return (unit * reps)[:num_chars].decode()


def body_of(model: str, field: str, path: str, text: str) -> bytes:
    """The JSON body putting ``text`` in ``field`` of a request to ``path``."""
    body: dict[str, Any] = {"model": model}
    if field == "prompt":
        body["prompt"] = text
    else:
        body["messages"] = [{"role": "user", "content": text}]
    if path != "/tokenize":
        body["max_tokens"] = 8
    return json.dumps(body).encode()


def frame_chunked(body: bytes, size: int = 1 << 16) -> bytes:
    """``body`` in HTTP/1.1 chunked framing (``Transfer-Encoding: chunked``), ``size`` bytes
    a chunk."""
    parts = []
    for i in range(0, len(body), size):
        chunk = body[i : i + size]
        parts += [f"{len(chunk):x}\r\n".encode(), chunk, b"\r\n"]
    return b"".join(parts) + b"0\r\n\r\n"


async def post_raw(
    host: str, port: int, path: str, body: bytes, chunked: bool = False
) -> dict[str, Any]:
    """``POST path`` with ``body`` on a new connection (``chunked``: ``body`` is already framed
    by ``frame_chunked`` and sent without a Content-Length); the status, the JSON error (if
    any), seconds until the response's head and until its end, from the first byte written."""
    reader, writer = await asyncio.open_connection(host, port)
    length = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {len(body)}"
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"{length}\r\nConnection: close\r\n\r\n"
    ).encode()
    out: dict[str, Any] = {"body_bytes": len(body)}
    t0 = time.perf_counter()
    writer.write(head + body)

    async def drain() -> str:
        try:
            await writer.drain()
            return "all"
        except OSError as e:  # the server closed before reading the whole body
            return f"cut: {type(e).__name__}"

    sending = asyncio.ensure_future(drain())
    try:
        raw_head = await reader.readuntil(b"\r\n\r\n")
        out["head_s"] = time.perf_counter() - t0
        lines = raw_head.decode("latin-1").split("\r\n")
        out["status"] = int(lines[0].split()[1])
        headers = {
            k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])
        }
        if "content-length" in headers:
            data = await reader.readexactly(int(headers["content-length"]))
        else:
            data = await reader.read()
        out["total_s"] = time.perf_counter() - t0
        try:
            out["error"] = json.loads(data).get("error")
        except ValueError:
            out["error"] = {"raw": data[:300].decode(errors="replace")}
    except (OSError, asyncio.IncompleteReadError) as e:
        out["status"] = None
        out["transport_error"] = repr(e)
        out["total_s"] = time.perf_counter() - t0
    finally:
        writer.close()
        await asyncio.sleep(0)
        out["body_sent"] = await sending if sending.done() else "pending at close"
        if not sending.done():
            sending.cancel()
    return out


# --------------------------------------------------------------------------- /health poller


def _poll_health(host: str, port: int, period_s: float, conn: Any) -> None:
    """In a process of its own: ``GET /health`` every ``period_s`` on one keep-alive
    connection until the pipe says stop; sends back [(wall time, seconds, status)]."""
    import http.client

    samples: list[tuple[float, float, int]] = []
    client = http.client.HTTPConnection(host, port, timeout=10)
    next_t = time.perf_counter()
    while not conn.poll():
        wall = time.time()
        t0 = time.perf_counter()
        try:
            client.request("GET", "/health")
            r = client.getresponse()
            r.read()
            status = r.status
        except (OSError, http.client.HTTPException):
            status = -1
            client.close()
            client = http.client.HTTPConnection(host, port, timeout=10)
        samples.append((wall, time.perf_counter() - t0, status))
        next_t += period_s
        time.sleep(max(0.0, next_t - time.perf_counter()))
    conn.send(samples)


class HealthPoller:
    """Runs ``_poll_health`` in a spawned process (its timing is not disturbed by this
    process's work); ``samples`` after the ``with`` block."""

    def __init__(self, host: str, port: int, period_s: float) -> None:
        ctx = mp.get_context("spawn")
        self.parent, child = ctx.Pipe()
        self.proc = ctx.Process(target=_poll_health, args=(host, port, period_s, child))
        self.samples: list[tuple[float, float, int]] = []

    def __enter__(self) -> HealthPoller:
        self.proc.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.parent.send("stop")
        if self.parent.poll(30):
            self.samples = self.parent.recv()
        self.proc.join(10)


def health_stats(samples: list[tuple[float, float, int]], t0: float, t1: float) -> dict[str, Any]:
    """Max / p50 / p99 latency (ms) and non-200 count of the polls begun in [t0, t1]."""
    xs = sorted(dt for w, dt, _ in samples if t0 <= w <= t1)
    bad = sum(1 for w, _, s in samples if t0 <= w <= t1 and s != 200)
    if not xs:
        return {"count": 0}
    return {
        "count": len(xs),
        "max_ms": round(xs[-1] * 1000, 2),
        "p50_ms": round(xs[len(xs) // 2] * 1000, 2),
        "p99_ms": round(xs[min(len(xs) - 1, int(0.99 * len(xs)))] * 1000, 2),
        "not_200": bad,
    }


# --------------------------------------------------------------------------- the run


def check_case(r: dict[str, Any], expect: int, param: str) -> str | None:
    """Why the answer ``r`` is wrong (None if it is right)."""
    if r.get("status") != expect:
        return f"status {r.get('status')} (expected {expect}) {r.get('transport_error', '')}"
    err = r.get("error") or {}
    if err.get("code") != expect or not err.get("message"):
        return f"error body {err}"
    if expect == 400 and err.get("param") != param:
        return f"param {err.get('param')!r} (expected {param!r})"
    return None


def plot(result: dict[str, Any], path: Path) -> None:
    """/health latency (the slowest poll marked) and server RSS over the run, from the result
    JSON; phases shaded and named (skipped without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    polls = result["health"]["polls_s_ms_status"]
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True)
    a1.plot([t for t, _, _ in polls], [ms for _, ms, _ in polls], lw=0.7)
    if polls:
        worst = max(polls, key=lambda x: x[1])
        a1.plot([worst[0]], [worst[1]], "o", color="red", ms=4)
        a1.annotate(
            f"{worst[1]:.0f} ms",
            (worst[0], worst[1]),
            fontsize=7,
            xytext=(4, 0),
            textcoords="offset points",
        )
    a1.axhline(result["bounds"]["max_health_ms"], color="red", ls="--", lw=0.8)
    a1.set_ylabel("/health latency (ms)")
    a1.set_yscale("log")
    for k, (name, (p0, p1)) in enumerate(result["phases"].items()):
        for ax in (a1, a2):
            ax.axvspan(p0, p1, alpha=0.12, color="orange")
        a2.text(p0, 0.02 + 0.12 * (k % 2), name, fontsize=6, transform=a2.get_xaxis_transform())
    for size, info in result["parallel"].items():
        p0 = result["phases"][f"parallel-{size}"][0]
        series = info.get("rss_timeline_s_bytes", [])
        a2.plot([p0 + t for t, _ in series], [b / 2**20 for _, b in series], lw=0.8, color="C0")
    a2.set_ylabel("server RSS (MiB)")
    a2.set_xlabel("seconds")
    fig.suptitle(f"huge prompts: {result['model']} on {result['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


async def run_cases(args: argparse.Namespace, server: LiveServer, model: str) -> dict[str, Any]:
    host, port = server.url.split("//", 1)[1].rsplit(":", 1)
    port_i = int(port)
    big, under = int(args.big_mb * 1_000_000), int(args.under_mb * 1_000_000)
    # "big-chunked": the big body without a Content-Length (the server reads up to its limit)
    sizes = {"big": big, "big-chunked": big, "under": under}
    expect = {"big": 413, "big-chunked": 413, "under": 400}
    texts = {k: text_of(n) for k, n in (("big", big), ("under", under))}
    bodies = {
        (size, name): body_of(model, field, path, texts[size])
        for size in ("big", "under")
        for name, path, field, _ in ENDPOINTS
    }
    for name, *_ in ENDPOINTS:
        bodies[("big-chunked", name)] = frame_chunked(bodies[("big", name)])
    paths = {name: (path, param) for name, path, _, param in ENDPOINTS}
    phases: dict[str, tuple[float, float]] = {}
    cases: list[dict[str, Any]] = []
    failures: list[str] = []

    def record(phase: str, size: str, name: str, r: dict[str, Any]) -> None:
        why = check_case(r, expect[size], paths[name][1])
        if why:
            failures.append(f"{phase} {name} {sizes[size]:,} characters: {why}")
        cases.append({"phase": phase, "case": name, "chars": sizes[size], **r, "problem": why})

    # CPU seconds of the server's own process (the HTTP front end) per phase: what the
    # phase cost it, whatever else the machine runs
    front_cpu: dict[str, float] = {}

    def cpu() -> float:
        return cpu_seconds(server.pid) if server.pid is not None else 0.0

    def end_phase(name: str, w0: float, c0: float) -> None:
        phases[name] = (w0, time.time())
        if server.pid is not None:
            front_cpu[name] = round(cpu() - c0, 3)

    w0, c0 = time.time(), cpu()
    await asyncio.sleep(args.idle_s)  # the poller's idle baseline
    end_phase("idle", w0, c0)

    # the first request of all: a cold server (no character limit computed yet)
    w0, c0 = time.time(), cpu()
    r = await post_raw(host, port_i, "/v1/completions", bodies[("under", "completions.prompt")])
    end_phase("cold", w0, c0)
    record("cold", "under", "completions.prompt", r)

    w0, c0 = time.time(), cpu()
    for name, path, field, _ in ENDPOINTS:  # one small request per endpoint
        small = body_of(model, field, path, "Hello there")
        r = await post_raw(host, port_i, path, small)
        if r.get("status") != 200:
            failures.append(f"warm-up {name}: status {r.get('status')} {r.get('error')}")
    await asyncio.sleep(0.5)
    end_phase("warm-up", w0, c0)

    for size in sizes:  # one at a time
        w0, c0 = time.time(), cpu()
        for name, path, _, _ in ENDPOINTS:
            r = await post_raw(host, port_i, path, bodies[(size, name)], size == "big-chunked")
            record(f"single-{size}", size, name, r)
            await asyncio.sleep(0.3)
        end_phase(f"single-{size}", w0, c0)

    parallel: dict[str, Any] = {}
    for size in sizes:  # args.parallel at once, endpoints in turn
        await asyncio.sleep(1.0)
        names = [ENDPOINTS[i % len(ENDPOINTS)][0] for i in range(args.parallel)]
        rss_before = server.rss_bytes()
        sampler = RssSampler(server.pid, 0.05) if server.pid is not None else None
        w0, c0 = time.time(), cpu()
        if sampler is not None:
            sampler.__enter__()
        try:
            t0 = time.perf_counter()
            got = await asyncio.gather(
                *(
                    post_raw(host, port_i, paths[n][0], bodies[(size, n)], size == "big-chunked")
                    for n in names
                )
            )
            wall = time.perf_counter() - t0
            await asyncio.sleep(0.5)  # memory freed (or not) after the answers
        finally:
            if sampler is not None:
                sampler.__exit__(None, None, None)
        end_phase(f"parallel-{size}", w0, c0)
        for n, r in zip(names, got):
            record(f"parallel-{size}", size, n, r)
        info: dict[str, Any] = {
            "requests": args.parallel,
            "chars_each": sizes[size],
            "wall_s": round(wall, 3),
            "max_total_s": round(max(r.get("total_s", 0.0) for r in got), 3),
            "statuses": [r.get("status") for r in got],
        }
        if sampler is not None and rss_before is not None:
            info.update(
                rss_before_bytes=rss_before,
                rss_peak_bytes=sampler.peak,
                rss_growth_mb=round((sampler.peak - rss_before) / 1e6, 1),
                rss_timeline_s_bytes=[[round(t, 2), b] for t, b in sampler.samples],
            )
            if info["rss_growth_mb"] > args.max_rss_growth_mb:
                failures.append(
                    f"parallel-{size}: server RSS peak {info['rss_growth_mb']} MB over the "
                    f"{rss_before / 1e6:.0f} MB before (limit +{args.max_rss_growth_mb} MB)"
                )
        parallel[size] = info
    return {
        "sizes": sizes,
        "cases": cases,
        "phases": phases,
        "parallel": parallel,
        "front_end_cpu_s": front_cpu,
        "failures": failures,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", default=None, help="attach to this server instead of starting one")
    p.add_argument("--model", default=None, help="model to serve (default: the packaged SmolLM2)")
    p.add_argument("--server-arg", action="append", default=[], help="a flag for pagedllm serve")
    p.add_argument("--device-label", default=None)
    p.add_argument("--big-mb", type=float, default=20.0, help="millions of characters (413)")
    p.add_argument("--under-mb", type=float, default=7.0, help="millions of characters (400)")
    p.add_argument("--parallel", type=int, default=8)
    p.add_argument("--health-period-ms", type=float, default=20.0)
    p.add_argument("--idle-s", type=float, default=5.0, help="idle /health baseline first")
    p.add_argument("--max-error-s", type=float, default=1.0)
    p.add_argument("--max-health-ms", type=float, default=100.0)
    p.add_argument("--max-rss-growth-mb", type=float, default=500.0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    with LiveServer(url=args.url, model=args.model, server_args=args.server_arg) as server:
        model = server.model_name()
        status, body = server.get("/v1/models")
        max_model_len = json.loads(body)["data"][0].get("max_model_len")
        print(f"server {server.url} (pid {server.pid}) serving {model}", flush=True)
        host, port = server.url.split("//", 1)[1].rsplit(":", 1)
        poller = HealthPoller(host, int(port), args.health_period_ms / 1000)
        load_start = os.getloadavg()
        t_begin = time.time()
        with poller:
            time.sleep(1.0)  # the poller's process starts
            out = asyncio.run(run_cases(args, server, model))
        t_end = time.time()
        alive = server.alive()
        log_errors = server.log_errors()
        exit_code = server.stop()

    health = poller.samples
    failures: list[str] = list(out["failures"])
    phases = out["phases"]
    health_by_phase = {name: health_stats(health, p0, p1) for name, (p0, p1) in phases.items()}
    health_all = health_stats(health, phases["cold"][0], t_end)
    for case in out["cases"]:
        if case.get("total_s", 1e9) > args.max_error_s and not case["phase"].startswith("par"):
            failures.append(
                f"{case['phase']} {case['case']}: error after {case['total_s']:.3f} s "
                f"(limit {args.max_error_s} s)"
            )
    if not health:
        failures.append("the /health poller recorded nothing")
    elif health_all.get("max_ms", 0) > args.max_health_ms:
        worst = max((x for x in health if x[0] >= phases["cold"][0]), key=lambda x: x[1])
        phase = next((n for n, (p0, p1) in phases.items() if p0 <= worst[0] <= p1), "between")
        failures.append(
            f"/health answered in {worst[1] * 1000:.1f} ms (limit {args.max_health_ms} ms), "
            f"during {phase}"
        )
    if health_all.get("not_200"):
        failures.append(f"/health answered other than 200 {health_all['not_200']} times")
    if not alive:
        failures.append("the server exited during the run")
    if exit_code not in (None, 0):
        failures.append(f"the server exited with {exit_code} after SIGTERM")

    device = args.device_label or device_label(flag_value(args.server_arg, "--device"))
    cases = [
        {k: (round(v, 4) if isinstance(v, float) else v) for k, v in c.items()}
        for c in out["cases"]
    ]
    result: dict[str, Any] = {
        "model": model,
        "device": device,
        "max_model_len": max_model_len,
        "server": server.summary(log_errors),
        "host": {
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
            "load_avg_start": load_start,
            "load_avg_end": os.getloadavg(),
        },
        **git_state(),
        "sizes_chars": out["sizes"],
        "bounds": {
            "max_error_s": args.max_error_s,
            "max_health_ms": args.max_health_ms,
            "max_rss_growth_mb": args.max_rss_growth_mb,
            "health_period_ms": args.health_period_ms,
        },
        "cases": cases,
        "parallel": out["parallel"],
        "front_end_cpu_s_by_phase": out["front_end_cpu_s"],
        "health": {
            "all": health_all,
            "by_phase": health_by_phase,
            "polls_s_ms_status": [
                [round(w - t_begin, 3), round(dt * 1000, 2), st] for w, dt, st in health
            ],
        },
        "phases": {
            k: [round(a - t_begin, 3), round(b - t_begin, 3)] for k, (a, b) in phases.items()
        },
        "passed": not failures,
        "failures": failures,
    }
    path = Path(args.out) if args.out else RESULTS / f"huge_prompt_{device}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, path.with_suffix(".png"))
    summarize(result)
    print(f"wrote {path}")
    return 0 if not failures else 1


def summarize(result: dict[str, Any]) -> None:
    print("\n=== huge prompts ===")
    print(f"{result['model']} on {result['device']} (max_model_len {result['max_model_len']})")
    for c in result["cases"]:
        print(
            f"  {c['phase']:>15} {c['case']:<18} {c['chars']:>11,} chars -> {c['status']} in "
            f"{c.get('total_s', float('nan')) * 1000:7.1f} ms"
            f"{'  PROBLEM: ' + c['problem'] if c['problem'] else ''}"
        )
    for size, info in result["parallel"].items():
        growth = info.get("rss_growth_mb")
        print(
            f"  parallel {size}: {info['requests']} x {info['chars_each']:,} chars, all answered "
            f"in {info['wall_s']:.3f} s, RSS peak {'+' if growth is not None else ''}"
            f"{growth if growth is not None else 'n/a'} MB"
        )
    h = result["health"]
    print(
        f"  /health: max {h['all'].get('max_ms')} ms over {h['all'].get('count')} polls; by "
        "phase: " + ", ".join(f"{k} {v.get('max_ms')}" for k, v in h["by_phase"].items())
    )
    print("PASS" if result["passed"] else "FAIL:\n  " + "\n  ".join(result["failures"]))


if __name__ == "__main__":
    sys.exit(main())
