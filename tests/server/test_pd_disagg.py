"""Prefill/decode disaggregation over HTTP (issue 54): two ``pagedllm serve`` processes (a
``kv_producer`` and a ``kv_consumer`` sharing a transfer directory) behind ``pagedllm proxy``
answer as one engine does; a transfer that is missing or truncated fails its request with a
400 and the consumer goes on; a streaming client that hangs up ends its decode; a killed
decode engine and a killed prefill engine each give the proxy's client a 502 while the other
engine goes on serving."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedllm.utils.child import stop_process, wait_healthy
from tests.server.conftest import (
    API_KEY,
    MAX_MODEL_LEN,
    MODEL_NAME,
    ROOT,
    LiveServer,
    _free_port,
    live_server,
)

httpx = pytest.importorskip("httpx")

PROMPT = "The three primary colours of light are red, green and blue. Mixing all three gives"
CHAT = [{"role": "user", "content": "Name three animals that live in the sea, one per line."}]


@contextlib.contextmanager
def _proxy(prefill: str, decode: str, log: Path) -> Iterator[str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "proxy", "--prefill", prefill,
           "--decode", decode, "--port", str(port)]  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                                stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        try:
            assert wait_healthy(proc, url, 60), log.read_text()
            yield url
        finally:
            stop_process(proc, 10)


def _role(buf: Path, role: str) -> tuple[str, ...]:
    config = {"kv_role": role, "kv_buffer_path": str(buf), "engine_id": role.split("_")[1]}
    return ("--kv-transfer-config", json.dumps(config))


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, LiveServer, str]]:
    root = tmp_path_factory.mktemp("pd")
    buf = root / "kv"
    with contextlib.ExitStack() as stack:
        producer = stack.enter_context(live_server(root / "p.log", _role(buf, "kv_producer")))
        consumer = stack.enter_context(live_server(root / "c.log", _role(buf, "kv_consumer")))
        proxy = stack.enter_context(_proxy(producer.url, consumer.url, root / "proxy.log"))
        yield producer, consumer, proxy


def _post(url: str, path: str, body: dict) -> httpx.Response:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    return httpx.post(url + path, json={"model": MODEL_NAME, **body}, headers=headers, timeout=120)


def _completion(url: str, **kw: object) -> dict:
    r = _post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 24, "temperature": 0,
                                       **kw})  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()


def test_the_proxy_answers_as_one_engine(pair):
    """Completions (whole and streamed) and chat through the proxy equal the producer's own
    answers as a plain engine; the consumer took the prompts' KV instead of computing it."""
    producer, consumer, proxy = pair
    before = consumer.metric("pagedllm:kv_transfer_received_tokens_total")
    ref = _completion(producer.url)["choices"][0]["text"]
    got = _completion(proxy)
    assert got["choices"][0]["text"] == ref
    assert "kv_transfer_params" not in got  # the decode side's answer: nothing to hand over
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 24, "temperature": 0,
            "stream": True}  # fmt: skip
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", proxy + "/v1/completions", timeout=120, headers=headers,
                      json=body) as r:  # fmt: skip
        assert r.status_code == 200
        events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    streamed = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert streamed == ref
    chat = {"messages": CHAT, "max_completion_tokens": 24, "temperature": 0}
    ref_chat = _post(producer.url, "/v1/chat/completions", chat).json()
    got_chat = _post(proxy, "/v1/chat/completions", chat).json()
    assert got_chat["choices"][0]["message"] == ref_chat["choices"][0]["message"]
    assert consumer.metric("pagedllm:kv_transfer_received_tokens_total") - before >= 3 * 16
    assert producer.metric("pagedllm:kv_transfer_sent_total") >= 3


def test_a_missing_or_truncated_transfer_is_a_400_and_the_consumer_goes_on(pair):
    """The consumer asked for a transfer that is not there, or that is cut short: 400 naming
    the reason; the next request through the proxy is exact."""
    producer, consumer, proxy = pair
    params = {"do_remote_prefill": True, "remote_engine_id": "producer",
              "remote_block_file": "producer-gone.kv"}  # fmt: skip
    r = _post(consumer.url, "/v1/completions",
              {"prompt": PROMPT, "max_tokens": 4, "kv_transfer_params": params})  # fmt: skip
    assert r.status_code == 400 and "is not in" in r.json()["error"]["message"], r.text
    handed = _completion(producer.url, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    params = handed["kv_transfer_params"]
    buf = producer.log_path.parent / "kv"
    path = buf / (params["remote_block_file"] + ".r0")
    path.write_bytes(path.read_bytes()[:-10])
    r = _post(consumer.url, "/v1/completions",
              {"prompt": PROMPT, "max_tokens": 4, "kv_transfer_params": params})  # fmt: skip
    assert r.status_code == 400 and "truncated" in r.json()["error"]["message"], r.text
    assert (
        _completion(proxy)["choices"][0]["text"] == _completion(producer.url)["choices"][0]["text"]
    )


def test_a_streaming_client_that_goes_away_ends_its_decode(pair):
    """A client reads the first chunk of a long stream through the proxy and hangs up: the
    decode engine aborts the request (had it generated to its end, it would count as
    "length", not "abort")."""
    _, consumer, proxy = pair
    aborted = consumer.metric("vllm:request_success_total", finished_reason="abort")
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": MAX_MODEL_LEN - 64,
            "ignore_eos": True, "stream": True}  # fmt: skip
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", proxy + "/v1/completions", json=body, headers=headers,
                      timeout=120) as r:  # fmt: skip
        assert r.status_code == 200
        next(r.iter_lines())
    deadline = time.monotonic() + 20
    while consumer.metric("vllm:request_success_total", finished_reason="abort") == aborted:
        assert time.monotonic() < deadline, "the decode engine did not abort the request"
        time.sleep(0.2)
    consumer.wait_idle()


def test_a_killed_decode_engine_leaves_the_prefill_engine_serving(pair, tmp_path):
    """A second consumer behind a second proxy is killed: that proxy answers 502 naming it;
    the producer serves, directly and through the first proxy."""
    producer, _, proxy = pair
    buf = producer.log_path.parent / "kv"
    with live_server(tmp_path / "c2.log", _role(buf, "kv_consumer")) as c2:
        with _proxy(producer.url, c2.url, tmp_path / "proxy2.log") as proxy2:
            assert _completion(proxy2)["choices"][0]["text"]
            c2_url = c2.url
            os.kill(c2.pid, 9)
            r = _post(proxy2, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
            assert r.status_code == 502, r.text
            assert c2_url in r.json()["error"]["message"]
    assert _completion(producer.url)["choices"][0]["text"]
    assert _completion(proxy)["choices"][0]["text"]


def test_a_killed_prefill_engine_leaves_the_decode_engine_serving(pair):
    """The producer is killed: the proxy answers 502 naming it; the consumer serves requests
    of its own, exactly as before (runs last: the pair has no producer after it)."""
    producer, consumer, proxy = pair
    ref = _completion(consumer.url)["choices"][0]["text"]
    os.kill(producer.pid, 9)
    r = _post(proxy, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
    assert r.status_code == 502 and producer.url in r.json()["error"]["message"], r.text
    assert _completion(consumer.url)["choices"][0]["text"] == ref
