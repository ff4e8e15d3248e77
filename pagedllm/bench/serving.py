"""``pagedllm bench serving``: a load generator for any OpenAI-compatible server.

Sends ``--num-prompts`` streaming requests to ``--base-url`` (``/completions`` or
``/chat/completions``), arriving as a Poisson process (``--request-rate``) and/or capped at
``--concurrency`` in flight. Prompts are ``--input-len`` random common words (about one token
each) or random token ids (``--prompt-type ids``, completions only); every request asks for
exactly ``--output-len`` tokens (``ignore_eos``, ``temperature 0``). Per request it measures TTFT
(send to first streamed text), TPOT ((latency - TTFT) / (output tokens - 1)) and ITL (gaps between
streamed chunks; a chunk may carry several tokens), and reports request and output-token
throughput with mean/p50/p99 of each.

The client (``--client``): ``raw`` (default) is a minimal HTTP/1.1 client on asyncio streams
(``pagedllm.bench._http_client``) that scans each read of the stream for text-carrying chunks
instead of decoding every event's JSON; ``httpx`` decodes every event as before. Both count the
same chunks and read the same usage. ``--client-processes N`` splits the prompts (each keeping its
arrival time) and the concurrency cap (as evenly as possible, summing to the cap) over N
processes, each with its own event loop, all starting at one shared time; their per-request
results are merged into one summary. ``--loop``: asyncio or uvloop (``auto``: uvloop where
installed). ``client_cpu_s`` in the summary is the client's CPU time in the timed part.

``--spawn-server`` starts ``pagedllm serve`` on a free loopback port with ``--server-args``,
waits for ``/health``, runs, and stops it. ``--spawn-canned`` instead starts the model-free
canned server (``pagedllm.bench.canned_server``, ``--canned-processes`` processes): the
client's own ceiling in output tokens/s and chunks/s. ``--offline`` then runs the same
prompts, arrival times and concurrency cap through an in-process ``pagedllm.LLM`` engine (built
from the same ``--server-args``) and reports what HTTP costs per output token. Results: JSON
and a PNG under ``--result-dir`` (default ``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing
import os
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from pagedllm.bench import _http_client
from pagedllm.bench._http_client import RawClient
from pagedllm.utils.child import stop_process, wait_healthy

WORDS = (
    "the of and to in is was for on are with as by at from this that have not but they his "
    "her one all were when there can an your which their said each she do how will up other "
    "about out many then them these so some would make like him into time has look two more "
    "write go see number no way could people my than first water been call who oil its now "
    "find long down day did get come made may part over new sound take only little work know "
    "place year live me back give most very after thing our just name good sentence man think "
    "say great where help through much before line right too mean old any same tell boy follow "
    "came want show also around form three small set put end does another well large must big "
    "even such because turn here why ask went men read need land different home us move try"
).split()

Prompt = str | list[int]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark's flags."""
    p.add_argument(
        "--base-url",
        default=None,
        metavar="URL",
        help="The server's API root, e.g. http://127.0.0.1:8000/v1 (default: unset; give it, "
        "--spawn-server, --spawn-canned or --offline-only).",
    )
    p.add_argument(
        "--model",
        default=None,
        metavar="NAME",
        help="Model name sent in each request (default: the first of the server's /models).",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("PAGEDLLM_API_KEY"),
        metavar="KEY",
        help="Sent as 'Authorization: Bearer KEY' (default: $PAGEDLLM_API_KEY; unset: none).",
    )
    p.add_argument(
        "--endpoint",
        choices=["completions", "chat"],
        default="completions",
        help="/completions or /chat/completions.",
    )
    p.add_argument("--num-prompts", type=int, default=64, metavar="N", help="Timed requests.")
    p.add_argument(
        "--input-len",
        type=int,
        default=128,
        metavar="N",
        help="Words (or token ids) per prompt.",
    )
    p.add_argument(
        "--output-len",
        type=int,
        default=64,
        metavar="N",
        help="Tokens each request asks for (ignore_eos: exactly this many).",
    )
    p.add_argument(
        "--prompt-type",
        choices=["words", "ids"],
        default="words",
        help="words: random common words (about one token each); ids: random token ids "
        "(completions only).",
    )
    p.add_argument(
        "--max-token-id",
        type=int,
        default=10000,
        metavar="N",
        help="--prompt-type ids: ids are in [100, N).",
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        metavar="REQ_PER_S",
        help="Poisson arrivals per second (inf: all at once).",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        default=None,
        metavar="N",
        help="Most requests in flight (default: no cap).",
    )
    p.add_argument(
        "--warmup", type=int, default=2, metavar="N", help="Untimed requests sent first."
    )
    p.add_argument("--seed", type=int, default=0, metavar="N", help="Seed of prompts and arrivals.")
    p.add_argument(
        "--client",
        choices=["raw", "httpx"],
        default="raw",
        help="raw: minimal asyncio HTTP/1.1 client (fast); httpx: httpx.AsyncClient.",
    )
    p.add_argument(
        "--client-processes",
        type=int,
        default=1,
        metavar="N",
        help="Client processes sharing the prompts and the concurrency cap.",
    )
    p.add_argument(
        "--loop",
        choices=["auto", "asyncio", "uvloop"],
        default="auto",
        help="Client event loop (auto: uvloop where installed).",
    )
    p.add_argument(
        "--spawn-server",
        action="store_true",
        help="Start 'pagedllm serve' itself (with --server-args) and stop it after.",
    )
    p.add_argument(
        "--spawn-canned",
        action="store_true",
        help="Start the model-free canned server instead: the client's own ceiling.",
    )
    p.add_argument(
        "--canned-processes",
        type=int,
        default=1,
        metavar="N",
        help="--spawn-canned: server processes.",
    )
    p.add_argument(
        "--canned-step-ms",
        type=float,
        default=0.0,
        metavar="MS",
        help="--spawn-canned: wait between token ticks (0: as fast as it can).",
    )
    p.add_argument(
        "--server-args",
        default="",
        metavar="ARGS",
        help="Engine flags for the spawned server and the offline engine, e.g. "
        "'--max-model-len 1024' (MODEL may lead; default: none).",
    )
    p.add_argument(
        "--offline", action="store_true", help="Also run the workload in-process (no HTTP)."
    )
    p.add_argument("--offline-only", action="store_true", help="Only the in-process run.")
    p.add_argument(
        "--result-dir",
        default="benchmarks/results",
        metavar="DIR",
        help="Folder of the result JSON and PNG.",
    )
    p.add_argument(
        "--result-name",
        default=None,
        metavar="STEM",
        help="Result file stem (default: serving_ENDPOINT_cCONCURRENCY_rRATE).",
    )
    p.add_argument("--no-plot", action="store_true", help="Write no PNG.")


@dataclass
class RequestResult:
    """One request as the client saw it (times in seconds from the benchmark's start)."""

    start: float
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    chunks: int = 0
    error: str | None = None


def make_prompts(args: argparse.Namespace, seed: int, n: int) -> list[Prompt]:
    """``n`` prompts of ``input_len`` random words or token ids."""
    rng = np.random.default_rng(seed)
    if args.prompt_type == "ids":
        return [rng.integers(100, args.max_token_id, args.input_len).tolist() for _ in range(n)]
    return [" ".join(rng.choice(WORDS, args.input_len)) for _ in range(n)]


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Send times (s): all 0 for an infinite rate, else a Poisson process of ``rate``/s."""
    if rate == float("inf"):
        return [0.0] * n
    gaps = np.random.default_rng(seed + 1).exponential(1.0 / rate, n)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])]).tolist()


def _body(args: argparse.Namespace, prompt: Prompt, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": args.model, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


async def _one(client: Any, args: argparse.Namespace, prompt: Prompt, max_tokens: int,
               t0: float) -> RequestResult:  # fmt: skip
    """Stream one request; time each chunk that carries text."""
    path = "/chat/completions" if args.endpoint == "chat" else "/completions"
    sent = time.perf_counter()
    r = RequestResult(start=sent - t0)
    stamps: list[float] = []
    try:
        async with client.stream("POST", path, json=_body(args, prompt, max_tokens)) as resp:
            if resp.status_code != 200:
                r.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if obj.get("usage"):
                    r.prompt_tokens = obj["usage"]["prompt_tokens"]
                    r.output_tokens = obj["usage"]["completion_tokens"]
                for c in obj.get("choices") or []:
                    text = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                    if text:
                        stamps.append(time.perf_counter())
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
        r.error = f"{type(e).__name__}: {e}"
        return r
    return _timed_result(r, sent, stamps)


# --client raw reads text-carrying chunks off the raw SSE bytes: a JSON string can't hold an
# unescaped quote, so '"text":"' (or '"content":"') followed by a non-quote is a choice's
# non-empty text and nothing else; the usage chunk and [DONE] go through json.loads as before.
_TEXT = re.compile(rb'"(?:text|content)"\s*:\s*"(?!")')
_USAGE = re.compile(rb'"usage"\s*:\s*\{')


async def _one_raw(client: RawClient, args: argparse.Namespace, prompt: Prompt,
                   max_tokens: int, t0: float) -> RequestResult:  # fmt: skip
    """``_one`` on the raw client: the same chunks timed, the same usage read. Each read from
    the socket is scanned whole; the chunks it completes share its arrival time."""
    path = "/chat/completions" if args.endpoint == "chat" else "/completions"
    body = json.dumps(_body(args, prompt, max_tokens)).encode()
    sent = time.perf_counter()
    r = RequestResult(start=sent - t0)
    stamps: list[float] = []
    rest = b""
    done = False

    def on_line(line: bytes) -> None:  # the slow path: one SSE line as _one reads it
        nonlocal done
        if done or not line.startswith(b"data:"):
            return
        data = line[5:].strip()
        if data == b"[DONE]":
            done = True
            return
        n = len(_TEXT.findall(data))
        if n:
            stamps.extend(itertools.repeat(time.perf_counter(), n))
        if _USAGE.search(data):
            usage = json.loads(data).get("usage")
            if usage:
                r.prompt_tokens = usage["prompt_tokens"]
                r.output_tokens = usage["completion_tokens"]

    def on_data(data: bytes) -> None:
        nonlocal rest
        if rest:
            data = rest + data
        end = data.rfind(b"\n") + 1
        rest = data[end:]
        if not end or done:
            return
        # lines from the first usage or [DONE] (once per request) go through on_line
        slow = data.find(b"[DONE]", 0, end)
        if b'"usage"' in data:
            m = _USAGE.search(data, 0, end)
            if m and (slow < 0 or m.start() < slow):
                slow = m.start()
        if slow >= 0:
            slow = data.rfind(b"\n", 0, slow) + 1
        n = len(_TEXT.findall(data, 0, end if slow < 0 else slow))
        if n:
            stamps.extend(itertools.repeat(time.perf_counter(), n))
        if slow >= 0:
            for line in data[slow:end].split(b"\n"):
                on_line(line.rstrip(b"\r"))

    try:
        status, err = await client.post_stream(path, body, on_data)
        if status != 200:
            r.error = f"HTTP {status}: {err[:300]!r}"
            return r
        if rest:
            on_line(rest.rstrip(b"\r"))
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
        r.error = f"{type(e).__name__}: {e}"
        return r
    return _timed_result(r, sent, stamps)


def _timed_result(r: RequestResult, sent: float, stamps: list[float]) -> RequestResult:
    """Fill in a streamed request's timings from its send time and text-chunk stamps."""
    r.latency = time.perf_counter() - sent
    r.chunks = len(stamps)
    r.output_tokens = r.output_tokens or len(stamps)
    if stamps:
        r.ttft = stamps[0] - sent
        r.itl = np.diff(stamps).tolist()
    else:
        r.error = "no text streamed"
    return r


OneRequest = Callable[..., Any]  # _one or _one_raw


@asynccontextmanager
async def open_client(args: argparse.Namespace) -> AsyncIterator[tuple[Any, OneRequest]]:
    """The ``--client`` for ``--base-url`` and its request coroutine (``_one``/``_one_raw``);
    ``--model`` is filled in from ``/models`` when not given."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    base = args.base_url.rstrip("/")
    if args.client == "httpx":
        import httpx

        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=base, headers=headers, timeout=httpx.Timeout(None),
                                     limits=limits) as client:  # fmt: skip
            if args.model is None:
                args.model = (await client.get("/models")).json()["data"][0]["id"]
            yield client, _one
    else:
        async with RawClient(base, headers) as raw:
            if args.model is None:
                args.model = (await raw.get_json("/models"))["data"][0]["id"]
            yield raw, _one_raw


async def _warmup(args: argparse.Namespace, client: Any, one: OneRequest) -> None:
    warm = make_prompts(args, args.seed + 1000, args.warmup)
    for r in await asyncio.gather(*(one(client, args, p, 4, 0.0) for p in warm)):
        if r.error:
            raise RuntimeError(f"warm-up request failed: {r.error}")


async def _timed(args: argparse.Namespace, client: Any, one: OneRequest, prompts: list[Prompt],
                 arrivals: list[float], cap: int | None, t0: float
                 ) -> tuple[list[RequestResult], float, float]:  # fmt: skip
    """Send each prompt at ``t0`` + its arrival time, at most ``cap`` in flight; ``t0`` is a
    ``perf_counter`` time, possibly still ahead. Returns the results, the seconds since t0 and
    the CPU seconds this process spent meanwhile."""
    cpu = time.process_time()
    sem = asyncio.Semaphore(cap or max(1, len(prompts)))

    async def send(prompt: Prompt, at: float) -> RequestResult:
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
        async with sem:
            return await one(client, args, prompt, args.output_len, t0)

    results = await asyncio.gather(*(send(p, a) for p, a in zip(prompts, arrivals)))
    return list(results), time.perf_counter() - t0, time.process_time() - cpu


async def run_http(args: argparse.Namespace, prompts: list[Prompt], arrivals: list[float]
                   ) -> tuple[list[RequestResult], float, float]:  # fmt: skip
    """The timed HTTP run (after ``--warmup`` untimed requests) from this process: results,
    elapsed seconds and the client's CPU seconds."""
    async with open_client(args) as (client, one):
        await _warmup(args, client, one)
        return await _timed(args, client, one, prompts, arrivals, args.concurrency,
                            time.perf_counter())  # fmt: skip


def split_work(n_prompts: int, concurrency: int | None, processes: int
               ) -> list[tuple[list[int], int | None]]:  # fmt: skip
    """(prompt indices, concurrency cap) per client process. The cap is split as evenly as
    possible (the caps sum to ``concurrency``; None: no cap anywhere); prompts are dealt in
    arrival order, each to the process with the fewest per unit of cap, so every process sees
    the whole span of arrival times. No more processes than prompts or than the cap."""
    n = max(1, min(processes, n_prompts, concurrency or n_prompts))
    caps: list[int | None]
    if concurrency is None:
        caps = [None] * n
    else:
        caps = [concurrency // n + (k < concurrency % n) for k in range(n)]
    weights = [c or 1 for c in caps]
    shares: list[list[int]] = [[] for _ in range(n)]
    for i in range(n_prompts):
        k = min(range(n), key=lambda k: ((len(shares[k]) + 1) / weights[k], k))
        shares[k].append(i)
    return list(zip(shares, caps))


def _client_process(args: argparse.Namespace, prompts: list[Prompt], arrivals: list[float],
                    cap: int | None, conn: Any) -> None:  # fmt: skip
    """One of ``--client-processes``: open its client, report ready, receive the shared start
    time (a ``time.time()``), run its share from then and send back its results."""
    try:

        async def go() -> tuple[list[RequestResult], float, float]:
            async with open_client(args) as (client, one):
                conn.send(("ready", None))
                start_wall = conn.recv()  # blocks the loop, which has nothing else to do yet
                t0 = time.perf_counter() + (start_wall - time.time())
                return await _timed(args, client, one, prompts, arrivals, cap, t0)

        results, elapsed, cpu = _http_client.run(go(), args.loop)
        conn.send(("done", ([asdict(r) for r in results], elapsed, cpu)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def _recv(conn: Any, proc: Any, timeout: float | None) -> Any:
    """The next message from a client process (RuntimeError if it exits or times out first)."""
    from multiprocessing.connection import wait

    ready = wait([conn, proc.sentinel], timeout)
    if conn in ready:
        try:
            return conn.recv()
        except EOFError:
            pass
    if not ready:
        raise RuntimeError(f"client process sent nothing in {timeout} s")
    proc.join(1)
    raise RuntimeError(
        f"client process exited (code {proc.exitcode}) without a result (a "
        "script needs `if __name__ == '__main__':`: spawn imports its main module)"
    )


def run_http_processes(args: argparse.Namespace, prompts: list[Prompt], arrivals: list[float]
                       ) -> tuple[list[RequestResult], float, float]:  # fmt: skip
    """``run_http`` over ``--client-processes`` spawned processes (warm-up and model lookup in
    this one); results in prompt order, elapsed from the shared start to the last finish, CPU
    seconds of all the processes."""

    async def prepare() -> None:
        async with open_client(args) as (client, one):
            await _warmup(args, client, one)

    _http_client.run(prepare(), args.loop)
    ctx = multiprocessing.get_context("spawn")
    work = split_work(len(prompts), args.concurrency, args.client_processes)
    procs, conns = [], []
    try:
        for idx, cap in work:
            mine, theirs = ctx.Pipe()
            share = ([prompts[i] for i in idx], [arrivals[i] for i in idx])
            p = ctx.Process(target=_client_process, args=(args, *share, cap, theirs), daemon=True)
            p.start()
            theirs.close()
            procs.append(p)
            conns.append(mine)
        for c, p in zip(conns, procs):
            kind, payload = _recv(c, p, 120.0)
            if kind != "ready":
                raise RuntimeError(f"client process failed:\n{payload}")
        start_wall = time.time() + 0.05  # every process has its start time by then
        for c in conns:
            c.send(start_wall)
        results: list[RequestResult | None] = [None] * len(prompts)
        elapsed = cpu = 0.0
        for (idx, _), c, p in zip(work, conns, procs):
            kind, payload = _recv(c, p, None)
            if kind != "done":
                raise RuntimeError(f"client process failed:\n{payload}")
            rs, el, cp = payload
            for i, d in zip(idx, rs):
                results[i] = RequestResult(**d)
            elapsed, cpu = max(elapsed, el), cpu + cp
    finally:
        for c in conns:
            c.close()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.terminate()
                p.join()
    assert all(r is not None for r in results)
    return [r for r in results if r is not None], elapsed, cpu


def http_run(args: argparse.Namespace, prompts: list[Prompt], arrivals: list[float]
             ) -> tuple[list[RequestResult], float, float]:  # fmt: skip
    """The timed HTTP run, from this process or from ``--client-processes`` processes: results,
    elapsed seconds, client CPU seconds."""
    if args.client_processes > 1:
        return run_http_processes(args, prompts, arrivals)
    return _http_client.run(run_http(args, prompts, arrivals), args.loop)


def build_llm(args: argparse.Namespace) -> Any:
    """A ``pagedllm.LLM`` from ``--server-args`` parsed exactly as ``pagedllm serve`` would."""
    import dataclasses

    from pagedllm import LLM
    from pagedllm.config import engine_args_from
    from pagedllm.entrypoints.cli import build_parser

    ea = engine_args_from(build_parser().parse_args(["serve", *shlex.split(args.server_args)]))
    return LLM(ea.model, **{k: v for k, v in dataclasses.asdict(ea).items() if k != "model"})


def run_offline(args: argparse.Namespace, llm: Any, prompts: list[Prompt],
                arrivals: list[float]) -> tuple[list[RequestResult], float]:  # fmt: skip
    """The same workload driven through ``llm``'s engine in-process: requests join at their
    arrival time while fewer than ``--concurrency`` are in flight; tokens are timed per step."""
    from pagedllm import SamplingParams

    engine = llm.llm_engine
    inputs: list[Any] = [{"prompt_token_ids": p} if isinstance(p, list) else p for p in prompts]
    if args.endpoint == "chat":
        tok = llm.get_tokenizer()
        texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                         add_generation_prompt=True) for p in prompts]  # fmt: skip
        inputs = [{"prompt": t, "prompt_token_ids": tok.encode(t, add_special_tokens=False)}
                  for t in texts]  # fmt: skip
    llm.generate(inputs[: args.warmup], SamplingParams(max_tokens=4, ignore_eos=True),
                 use_tqdm=False)  # fmt: skip
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    cap = args.concurrency or len(prompts)
    results: dict[int, RequestResult] = {}
    stamps: dict[int, list[float]] = {}
    index: dict[str, int] = {}
    nxt, in_flight = 0, 0
    t0 = time.perf_counter()
    while nxt < len(prompts) or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while nxt < len(prompts) and in_flight < cap and arrivals[nxt] <= now:
            rid = engine.next_request_id()
            engine.add_request(rid, inputs[nxt], sp, output_kind="delta")
            index[rid], results[nxt], stamps[nxt] = nxt, RequestResult(start=now), []
            nxt, in_flight = nxt + 1, in_flight + 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[nxt] - now))
            continue
        for out in engine.step():
            t, i = time.perf_counter() - t0, index[out.request_id]
            r = results[i]
            n = len(out.outputs[0].token_ids) if out.outputs else 0
            if n:
                stamps[i].append(t)
                r.output_tokens += n
            r.prompt_tokens = len(out.prompt_token_ids)
            if out.finished:
                in_flight -= 1
                r.latency, r.chunks = t - r.start, len(stamps[i])
                r.ttft = stamps[i][0] - r.start if stamps[i] else 0.0
                r.itl = np.diff(stamps[i]).tolist()
                r.error = out.error
    return [results[i] for i in range(len(prompts))], time.perf_counter() - t0


def _stats(values: list[float]) -> dict[str, float | None]:
    """mean/p50/p99 in milliseconds (None when there are no values)."""
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    a = np.asarray(values) * 1e3
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
            "p99": float(np.percentile(a, 99))}  # fmt: skip


def summarize(results: list[RequestResult], elapsed: float,
              client_cpu_s: float | None = None) -> dict[str, Any]:  # fmt: skip
    """Throughput and latency statistics of one run, plus the per-request records
    (``client_cpu_s``: CPU seconds the HTTP client spent in the timed part, all processes)."""
    ok = [r for r in results if r.error is None]
    n_out = sum(r.output_tokens for r in ok)
    n_chunks = sum(r.chunks for r in ok)
    return {
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "elapsed_s": elapsed,
        "total_input_tokens": sum(r.prompt_tokens for r in ok),
        "total_output_tokens": n_out,
        "request_throughput": len(ok) / elapsed,
        "output_throughput": n_out / elapsed,
        "total_chunks": n_chunks,
        "chunk_throughput": n_chunks / elapsed,  # streamed chunks carrying text, per second
        "mean_tokens_per_chunk": n_out / max(1, n_chunks),
        "client_cpu_s": client_cpu_s,
        "ttft_ms": _stats([r.ttft for r in ok]),
        "tpot_ms": _stats(
            [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
        ),  # fmt: skip
        "itl_ms": _stats([x for r in ok for x in r.itl]),
        "e2el_ms": _stats([r.latency for r in ok]),
        "requests": [asdict(r) | {"itl": [round(x, 6) for x in r.itl]} for r in results],
    }


@contextmanager
def spawned_server(args: argparse.Namespace) -> Iterator[str]:
    """``pagedllm serve --server-args`` on a free loopback port; yields its ``/v1`` URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--port", str(port),
           "--uvicorn-log-level", "warning", *shlex.split(args.server_args)]  # fmt: skip
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    log = tempfile.NamedTemporaryFile("w+", prefix="pagedllm_serve_", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        if not wait_healthy(proc, url, 300):
            raise RuntimeError(f"server did not start (log: {log.name})")
        yield f"{url}/v1"
    finally:
        stop_process(proc, 20)
        log.close()


def plot(result: dict[str, Any], path: str) -> None:
    """TTFT and TPOT per request over send time, the ITL histogram, and output tokens/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {k: result[k] for k in ("server", "offline") if result.get(k)}
    fig, ax = plt.subplots(2, 2, figsize=(11, 7))
    for name, s in runs.items():
        ok = [r for r in s["requests"] if r["error"] is None]
        starts = [r["start"] for r in ok]
        ax[0, 0].scatter(starts, [1e3 * r["ttft"] for r in ok], s=10, label=name)
        tpot = [1e3 * (r["latency"] - r["ttft"]) / max(1, r["output_tokens"] - 1) for r in ok]
        ax[0, 1].scatter(starts, tpot, s=10, label=name)
        itl = [1e3 * x for r in ok for x in r["itl"]]
        if itl:
            ax[1, 0].hist(itl, bins=50, alpha=0.6, label=name)
    ax[1, 1].bar(list(runs), [s["output_throughput"] for s in runs.values()])
    titles = [
        ("TTFT per request", "send time (s)", "ms"),
        ("TPOT per request", "send time (s)", "ms"),
        ("ITL histogram", "ms", "count"),
        ("output tokens/s", "", "tok/s"),
    ]
    for a, (t, x, y) in zip(ax.flat, titles):
        a.set_title(t)
        a.set_xlabel(x)
        a.set_ylabel(y)
    for a in ax.flat[:3]:
        if runs:
            a.legend()
    w = result["workload"]
    fig.suptitle(
        f"{result['model']} {w['endpoint']}: {w['num_prompts']} prompts, "
        f"in {w['input_len']} out {w['output_len']}, "
        f"concurrency {w['concurrency']}, rate {w['request_rate']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _brief(s: dict[str, Any]) -> dict[str, Any]:
    keys = ("completed", "request_throughput", "output_throughput", "chunk_throughput", "ttft_ms",
            "tpot_ms", "itl_ms", "client_cpu_s")  # fmt: skip
    return {k: s[k] for k in keys}


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Run the configured benchmark; returns the result dict (also written as JSON + PNG)."""
    prompts = make_prompts(args, args.seed, args.num_prompts)
    arrivals = arrival_times(args.num_prompts, args.request_rate, args.seed)
    if args.endpoint == "chat" and args.prompt_type == "ids":
        raise ValueError("token-id prompts need --endpoint completions")
    server = None
    if not args.offline_only:
        if args.spawn_server and args.spawn_canned:
            raise ValueError("give one of --spawn-server and --spawn-canned")
        if args.spawn_server:
            with spawned_server(args) as url:
                args.base_url = url
                server = summarize(*http_run(args, prompts, arrivals))
        elif args.spawn_canned:
            from pagedllm.bench import canned_server

            canned = canned_server.spawned(
                args.canned_processes, step_ms=args.canned_step_ms, loop=args.loop
            )
            with canned as url:
                args.base_url = url
                server = summarize(*http_run(args, prompts, arrivals))
        elif args.base_url:
            server = summarize(*http_run(args, prompts, arrivals))
        else:
            raise ValueError("give --base-url, --spawn-server, --spawn-canned or --offline-only")
    offline = None
    if args.offline or args.offline_only:
        offline = summarize(*run_offline(args, build_llm(args), prompts, arrivals))
    result: dict[str, Any] = {
        "benchmark": "serving", "base_url": args.base_url, "model": args.model,
        "server_args": args.server_args, "cpu_count": os.cpu_count(),
        "client": args.client, "client_processes": args.client_processes,
        "loop": _http_client.loop_name(args.loop),
        "canned_server": {"processes": args.canned_processes, "step_ms": args.canned_step_ms}
        if args.spawn_canned else None,
        "workload": {k: getattr(args, k) for k in ("endpoint", "num_prompts", "input_len",
                     "output_len", "prompt_type", "request_rate", "concurrency", "seed")},
        "server": server, "offline": offline, "http_overhead": None,
    }  # fmt: skip
    if server and offline and server["output_throughput"] and offline["output_throughput"]:
        per_tok = 1e3 / server["output_throughput"] - 1e3 / offline["output_throughput"]
        result["http_overhead"] = {
            "ms_per_output_token": per_tok,  # extra wall time per generated token, whole batch
            "throughput_ratio": server["output_throughput"] / offline["output_throughput"],
            "tpot_p50_delta_ms": (server["tpot_ms"]["p50"] or 0) - (offline["tpot_ms"]["p50"] or 0),
        }
    os.makedirs(args.result_dir, exist_ok=True)
    c = args.concurrency or "inf"
    stem = args.result_name or f"serving_{args.endpoint}_c{c}_r{args.request_rate}" + (
        "_canned" if args.spawn_canned else ""
    )
    path = os.path.join(args.result_dir, stem)
    with open(path + ".json", "w") as f:
        json.dump(result, f, indent=2)
    if not args.no_plot:
        plot(result, path + ".png")
    result["paths"] = [path + ".json"] + ([] if args.no_plot else [path + ".png"])
    return result


def main(args: argparse.Namespace) -> int:
    """``pagedllm bench serving``: run, print a summary, return 0 when every request succeeded."""
    result = run_benchmark(args)
    brief = {k: _brief(result[k]) for k in ("server", "offline") if result[k]}
    print(json.dumps(brief | {"http_overhead": result["http_overhead"]}, indent=2))
    print("wrote " + " ".join(result["paths"]))
    return int(any(result[k] and result[k]["failed"] for k in ("server", "offline")))
