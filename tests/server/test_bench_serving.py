"""``pagedllm bench serving``: against the live test server (4 streamed prompts x 8 tokens, with
each client), against the canned server (the raw and httpx clients agree, client processes merge),
and the raw client's parsing against httpx + ``_one`` on the same bytes split every way."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pagedllm.bench import _http_client, canned_server, serving
from tests.server.conftest import LiveServer


@pytest.mark.parametrize("client", ["raw", "httpx"])
@pytest.mark.parametrize("endpoint,prompt_type", [("completions", "ids"), ("chat", "words")])
def test_bench_serving_fields(
    server: LiveServer, tmp_path: Path, endpoint: str, prompt_type: str, client: str
) -> None:
    parser = argparse.ArgumentParser()
    serving.add_arguments(parser)
    args = parser.parse_args(
        ["--base-url", f"{server.url}/v1", "--api-key", server.api_key,
         "--endpoint", endpoint, "--prompt-type", prompt_type, "--num-prompts", "4",
         "--client", client,
         "--input-len", "16", "--output-len", "8", "--concurrency", "2", "--warmup", "1",
         "--result-dir", str(tmp_path), "--result-name", "t"]
    )  # fmt: skip
    result = serving.run_benchmark(args)
    assert result["model"] == server.model
    saved = json.loads((tmp_path / "t.json").read_text())
    assert (tmp_path / "t.png").stat().st_size > 0
    s = saved["server"]
    assert s["num_requests"] == s["completed"] == 4 and s["failed"] == 0, s["errors"]
    assert s["total_output_tokens"] == 4 * 8  # ignore_eos: exactly max_tokens each
    assert s["total_input_tokens"] >= 4 * 16
    assert s["request_throughput"] > 0 and s["output_throughput"] > 0
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        st = s[key]
        assert st["mean"] > 0 and 0 < st["p50"] <= st["p99"], (key, st)
    assert s["ttft_ms"]["p99"] <= s["e2el_ms"]["p99"]
    for r in s["requests"]:
        assert r["output_tokens"] == 8 and 0 < r["ttft"] < r["latency"]
        assert len(r["itl"]) == r["chunks"] - 1
    assert saved["offline"] is None and saved["http_overhead"] is None


# --- the raw client and the client processes, against the canned server (no model) ----------


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serving.add_arguments(parser)
    return parser.parse_args(["--no-plot", *argv])


@pytest.fixture(scope="module")
def canned_url() -> Iterator[str]:
    with canned_server.spawned(processes=2) as url:
        yield url


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_raw_and_httpx_clients_agree(canned_url: str, tmp_path: Path, endpoint: str) -> None:
    runs = {}
    for client in ("raw", "httpx"):
        args = _args("--base-url", canned_url, "--endpoint", endpoint, "--client", client,
                     "--num-prompts", "6", "--input-len", "12", "--output-len", "20",
                     "--concurrency", "3", "--warmup", "1", "--result-dir", str(tmp_path),
                     "--result-name", client)  # fmt: skip
        result = serving.run_benchmark(args)
        assert result["client"] == client and result["model"] == "canned"
        runs[client] = json.loads((tmp_path / f"{client}.json").read_text())["server"]
    for s in runs.values():
        assert s["completed"] == 6 and s["failed"] == 0, s["errors"]
        assert s["total_output_tokens"] == s["total_chunks"] == 6 * 20  # role chunk not counted
        assert s["total_input_tokens"] == 6 * 12  # the canned server counts words
        assert s["chunk_throughput"] > 0 and s["mean_tokens_per_chunk"] == 1
        for r in s["requests"]:
            assert r["output_tokens"] == r["chunks"] == 20 and len(r["itl"]) == 19
            assert 0 < r["ttft"] <= r["latency"]
    raw, ref = runs["raw"], runs["httpx"]
    for key in ("total_output_tokens", "total_chunks", "total_input_tokens"):
        assert raw[key] == ref[key], key
    pick = ("prompt_tokens", "output_tokens", "chunks")
    assert [[r[k] for k in pick] for r in raw["requests"]] == [
        [r[k] for k in pick] for r in ref["requests"]
    ]


def test_client_processes_merge(canned_url: str, tmp_path: Path) -> None:
    args = _args("--base-url", canned_url, "--endpoint", "chat", "--client-processes", "2",
                 "--loop", "asyncio", "--num-prompts", "7", "--input-len", "5", "--output-len", "9",
                 "--concurrency", "3", "--request-rate", "40", "--warmup", "1",
                 "--result-dir", str(tmp_path), "--result-name", "mp")  # fmt: skip
    result = serving.run_benchmark(args)
    s = result["server"]
    assert result["client_processes"] == 2 and result["loop"] == "asyncio"
    assert s["num_requests"] == s["completed"] == 7 and s["failed"] == 0, s["errors"]
    assert s["total_output_tokens"] == s["total_chunks"] == 7 * 9
    assert s["total_input_tokens"] == 7 * 5
    # in prompt order, each sent at its own arrival time from one shared start
    arrivals = serving.arrival_times(7, 40.0, 0)
    for r, at in zip(s["requests"], arrivals):
        assert r["output_tokens"] == r["chunks"] == 9 and len(r["itl"]) == 8
        assert at - 0.002 <= r["start"] < at + 0.5, (r["start"], at)
    assert s["elapsed_s"] >= max(r["start"] + r["latency"] for r in s["requests"]) - 1e-6


def test_split_work() -> None:
    for n, cap, procs in [(10, 7, 3), (10, None, 4), (5, 64, 8), (3, 2, 4), (64, 64, 2)]:
        work = serving.split_work(n, cap, procs)
        assert len(work) == min(procs, n, cap or n)
        assert sorted(i for idx, _ in work for i in idx) == list(range(n))
        for idx, _ in work:
            assert idx == sorted(idx)
        caps = [c for _, c in work]
        if cap is None:
            assert caps == [None] * len(work)
        else:
            assert sum(caps) == cap and max(caps) - min(caps) <= 1  # type: ignore[operator]
    assert serving.split_work(10, 7, 3) == [
        ([0, 3, 4, 7], 3), ([1, 5, 8], 2), ([2, 6, 9], 2)
    ]  # fmt: skip


# --- the raw client's parsing, against httpx + _one on the same bytes ------------------------

_CMPL = [
    {"choices": [{"index": 0, "text": "", "finish_reason": None}], "usage": None},
    {"choices": [{"index": 0, "text": " a", "finish_reason": None}], "usage": None},
    {"choices": [{"index": 0, "text": '"text":"x \\ [DONE]', "finish_reason": None}]},
    {
        "choices": [
            {
                "index": 0,
                "text": "é\n\n",
                "logprobs": {"top_logprobs": [{"text": -1.0}], "tokens": ["text"]},
            }
        ]
    },  # fmt: skip
    {"error": {"message": "text"}},
    {"choices": [{"index": 0, "text": "b", "finish_reason": "length"}], "usage": None},
    {"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 5, "total_tokens": 16}},
]
_CHAT = [
    {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}], "usage": None},
    {"choices": [{"index": 0, "delta": {"content": "x", "reasoning_content": "y"}}]},
    {"choices": [{"index": 0, "delta": {"reasoning_content": "y", "content": None}}]},
    {"choices": [{"index": 0, "delta": {"content": '"content":"q'}}]},
    {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
    {
        "choices": [
            {"index": 0, "delta": {"content": "z"}},
            {"index": 1, "delta": {"content": "w"}},
        ]
    },  # fmt: skip
    {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}},
]


def _sse(events: list[dict], compact: bool, crlf: bool) -> bytes:
    """The events as SSE; with ``crlf`` also no [DONE] and no newline after the last event."""
    sep = (",", ":") if compact else (", ", ": ")
    nl = "\r\n" if crlf else "\n"
    out = [f": keep-alive{nl}{nl}"]
    out += [f"data: {json.dumps(e, ensure_ascii=False, separators=sep)}{nl}{nl}" for e in events]
    if crlf:
        return "".join(out).rstrip().encode()
    out.append(f"data: [DONE]{nl}{nl}")
    out.append('data: {"choices": [{"text": "after done"}]}\n\n')  # never counted
    return "".join(out).encode()


def _chunked(body: bytes, size: int) -> bytes:
    pieces = [body[i : i + size] for i in range(0, len(body), size)]
    out = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in pieces)
    return out + b"0\r\nx-trailer: 1\r\n\r\n"


class _FakeRawClient:
    """``RawClient.post_stream`` replaying ``wire`` (a whole HTTP response) into a real _Conn
    ``step`` bytes at a time: every way the reads can split the framing and the events."""

    def __init__(self, wire: bytes, step: int) -> None:
        self.wire, self.step = wire, step

    async def post_stream(self, path: str, body: bytes, on_data: Any) -> tuple[int, bytes]:
        conn = _http_client._Conn()
        done = conn.start(on_data)
        for i in range(0, len(self.wire), self.step):
            conn.data_received(self.wire[i : i + self.step])
        status, data, keep = await done
        assert keep and not conn.rest
        return status, data


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("compact,crlf", [(True, False), (False, True)])
def test_raw_parsing_matches_httpx(endpoint: str, compact: bool, crlf: bool) -> None:
    body = _sse(_CMPL if endpoint == "completions" else _CHAT, compact, crlf)
    args = _args("--base-url", "http://x/v1", "--endpoint", endpoint, "--model", "m")

    async def reference() -> serving.RequestResult:
        def handler(request: httpx.Request) -> httpx.Response:
            return httpx.Response(200, content=body)

        async with httpx.AsyncClient(transport=httpx.MockTransport(handler),
                                     base_url="http://x/v1") as client:  # fmt: skip
            return await serving._one(client, args, "p", 5, 0.0)

    ref = asyncio.run(reference())
    assert ref.error is None
    assert (ref.chunks, ref.output_tokens) == ((4, 5) if endpoint == "completions" else (4, 4))
    head = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    plain = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    for wire in (head + _chunked(body, 5), head + _chunked(body, 1 << 16), plain):
        for step in (1, 3, 64, len(wire)):
            client = _FakeRawClient(wire, step)
            r = asyncio.run(serving._one_raw(client, args, "p", 5, 0.0))  # type: ignore[arg-type]
            assert r.error is None, r.error
            got = (r.chunks, r.output_tokens, r.prompt_tokens, len(r.itl))
            assert got == (ref.chunks, ref.output_tokens, ref.prompt_tokens, len(ref.itl)), step


def test_raw_client_errors_and_keepalive(canned_url: str) -> None:
    async def go() -> None:
        async with _http_client.RawClient(canned_url) as client:
            models = await client.get_json("/models")
            assert models["data"][0]["id"] == "canned"
            status, body = await client.request("GET", "/nope")
            assert status == 404 and b"no route" in body
            pieces: list[bytes] = []
            req = json.dumps({"prompt": "a b", "max_tokens": 3, "stream": True}).encode()
            for _ in range(3):  # one connection, kept alive across requests
                status, _ = await client.post_stream("/completions", req, pieces.append)
                assert status == 200
            assert len(client._idle) == 1
            text = b"".join(pieces)
            assert text.count(b'"text":" ') == 9 and text.count(b"data: [DONE]") == 3

    asyncio.run(go())
