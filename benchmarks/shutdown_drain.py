"""Graceful shutdown of a live ``pagedllm serve``: 16 open streams, then SIGTERM.

Three scenarios, each on a fresh server (default model unless ``--model``):
- ``drain``: streams short enough to finish within ``--shutdown-timeout`` 30 s: every stream
  must end normally (a finish_reason, ``[DONE]``); meanwhile ``/health`` must be 503 and a new
  request 503;
- ``deadline``: streams that cannot finish within ``--shutdown-timeout`` T (default 5 s): every
  stream must get a final 503 error event and ``[DONE]``, and the process must exit within
  T + 2 s of the signal;
- ``second_signal``: as ``deadline`` with a long timeout, and a second SIGTERM 1 s after the
  first: every stream ends at once with the error event, exit within 2 s of the second signal.

Writes ``benchmarks/results/shutdown_<device>.json`` (exit times, every stream's ending, the
probes) and exits non-zero when a bound fails. Usage: python benchmarks/shutdown_drain.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._live_server import LiveServer, device_label, git_state  # noqa: E402

NUM_STREAMS = 16
FLUSH_GRACE_S = 2.0


async def open_streams(url: str, body: dict, started: asyncio.Event,
                       num_streams: int = NUM_STREAMS) -> list[list[str]]:  # fmt: skip
    """``num_streams`` completion streams of ``body``, a connection each; ``started`` is set
    once every one has its first event. Each stream's data lines (a connection cut without
    ``[DONE]`` ends with a ``CUT: ...`` line). ``tests/server/test_shutdown.py`` uses it too."""
    lines: list[list[str]] = [[] for _ in range(num_streams)]
    first = [asyncio.Event() for _ in range(num_streams)]

    async def one(i: int) -> None:
        try:
            async with httpx.AsyncClient(timeout=600) as c:
                async with c.stream("POST", f"{url}/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            lines[i].append(line[6:])
                            first[i].set()
        except httpx.HTTPError as e:  # a connection cut without a final event
            lines[i].append(f"CUT: {type(e).__name__}")
            first[i].set()

    async def all_first() -> None:
        await asyncio.gather(*(e.wait() for e in first))
        started.set()

    waiter = asyncio.create_task(all_first())
    await asyncio.gather(*(one(i) for i in range(num_streams)))
    waiter.cancel()
    return lines


def stream_ending(lines: list[str]) -> dict[str, Any]:
    """How one stream ended: [DONE] seen, its last finish_reason, its error event."""
    done = bool(lines) and lines[-1] == "[DONE]"
    reason, error = None, None
    for x in lines:
        if not x.startswith("{"):
            continue
        e = json.loads(x)
        if "error" in e:
            error = {"code": e["error"]["code"], "message": e["error"]["message"][:80]}
        for c in e.get("choices", []):
            reason = c.get("finish_reason") or reason
    return {"done": done, "finish_reason": reason, "error": error, "events": len(lines)}


async def _scenario(name: str, args: argparse.Namespace) -> dict[str, Any]:
    timeout = 30.0 if name == "drain" else (args.timeout if name == "deadline" else 300.0)
    server_args = ["--shutdown-timeout", str(timeout), *args.server_args]
    max_tokens = args.short_tokens if name == "drain" else args.long_tokens
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "temperature": 0}  # fmt: skip
    server = LiveServer(model=args.model, server_args=server_args, stop_timeout_s=120)
    assert server.proc is not None
    try:
        started = asyncio.Event()
        task = asyncio.create_task(open_streams(server.url, body, started))
        await asyncio.wait_for(started.wait(), 300)
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        probes: dict[str, Any] = {}
        async with httpx.AsyncClient(timeout=30) as c:
            t = time.monotonic()
            probes["health_status"] = (await c.get(f"{server.url}/health")).status_code
            probes["health_ms"] = 1e3 * (time.monotonic() - t)
            r = await c.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            probes["new_request_status"] = r.status_code
        t_second = None
        if name == "second_signal":
            await asyncio.sleep(0.7)
            t_second = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
        lines = await asyncio.wait_for(task, 600)
        code = await asyncio.to_thread(server.proc.wait, 600)
        exit_s = time.monotonic() - t0
    finally:
        server.stop()
    endings = [stream_ending(x) for x in lines]
    result: dict[str, Any] = {
        "shutdown_timeout_s": timeout, "max_tokens": max_tokens, "exit_code": code,
        "exit_s_after_sigterm": exit_s, "probes": probes, "streams": endings,
    }  # fmt: skip
    fails = []
    if code != 0:
        fails.append(f"exit code {code}")
    if not all(e["done"] for e in endings):
        fails.append("a stream ended without [DONE]")
    if probes["health_status"] != 503 or probes["new_request_status"] != 503:
        fails.append(f"probes while draining: {probes}")
    if name == "drain":
        if any(e["error"] or not e["finish_reason"] for e in endings):
            fails.append("a stream did not finish normally")
    else:
        if not all(e["error"] and e["error"]["code"] == 503 for e in endings):
            fails.append("a stream lacks the final 503 error event")
        if name == "deadline" and exit_s > timeout + FLUSH_GRACE_S:
            fails.append(f"exit {exit_s:.2f} s > timeout {timeout} + {FLUSH_GRACE_S} s")
        if name == "second_signal":
            result["exit_s_after_second_signal"] = exit_s - (t_second - t0)
            if result["exit_s_after_second_signal"] > FLUSH_GRACE_S:
                fails.append("exit more than 2 s after the second signal")
    result["failures"] = fails
    print(f"{name}: exit {code} after {exit_s:.2f} s, endings "
          f"{sorted({(e['finish_reason'], (e['error'] or {}).get('code')) for e in endings})}, "
          f"probes {probes}, failures {fails}", flush=True)  # fmt: skip
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model to serve (default: the server's)")
    ap.add_argument("--timeout", type=float, default=5.0, help="deadline scenario's timeout")
    ap.add_argument("--short-tokens", type=int, default=32, help="drain scenario's max_tokens")
    ap.add_argument(
        "--long-tokens",
        type=int,
        default=1900,
        help="deadline scenarios' max_tokens (the prompt and these fit the context)",
    )
    ap.add_argument("--scenarios", default="drain,deadline,second_signal")
    ap.add_argument("--out", default=None, help="default: results/shutdown_<device>.json")
    ap.add_argument("server_args", nargs="*", help="extra `pagedllm serve` flags (after --)")
    args = ap.parse_args()
    device = device_label(None)
    results = {"benchmark": "shutdown_drain", "device": device, "num_streams": NUM_STREAMS,
               "git": git_state(), "scenarios": {}}  # fmt: skip
    for name in args.scenarios.split(","):
        results["scenarios"][name] = asyncio.run(_scenario(name, args))
    out = Path(args.out or Path(__file__).parent / "results" / f"shutdown_{device}.json")
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")
    return 1 if any(s["failures"] for s in results["scenarios"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
