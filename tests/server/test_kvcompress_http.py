"""KV-Compress over HTTP: the per-request fields work on a server started with --enable-kvc,
bad values are 400s naming the field, a server without it refuses them, and the server stays
healthy with every block free afterwards."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.server.conftest import LiveServer, live_server

CMPL = "/v1/completions"


@pytest.fixture(scope="module")
def kvc_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("kvc_server") / "server.log"
    with live_server(log, ("--enable-kvc", "--protected-window-size", "8")) as srv:
        yield srv


def _post(srv: LiveServer, body: dict) -> httpx.Response:
    return httpx.post(srv.url + CMPL, json=body, headers=srv.headers, timeout=120)


def test_fields_compress_and_answer(kvc_server: LiveServer) -> None:
    prompt = "The quick brown fox jumps over the lazy dog. " * 20
    base = {"model": kvc_server.model, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    full = _post(kvc_server, base)
    assert full.status_code == 200, full.text
    roomy = _post(kvc_server, {**base, "max_cache_tokens": 4096})
    assert roomy.json()["choices"][0]["text"] == full.json()["choices"][0]["text"]
    for extra in (
        {"max_cache_tokens": 32},
        {"compression_rate": 4, "compress_once": True},
        {"compression_rate": 2.5, "protected_window_size": 16},
    ):
        r = _post(kvc_server, {**base, **extra})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
    evicted = kvc_server.metric("pagedllm:kvc_evicted_kvs_total")
    assert evicted > 0
    kvc_server.wait_idle()


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"max_cache_tokens": 0}, "max_cache_tokens"),
        ({"max_cache_tokens": "many"}, "max_cache_tokens"),
        ({"compression_rate": 0.5}, "compression_rate"),
        ({"compression_rate": 2, "max_cache_tokens": 16}, "compression_rate"),
        ({"protected_window_size": -3}, "protected_window_size"),
        ({"compress_once": "sometimes"}, "compress_once"),
    ],
)
def test_bad_values_are_400(kvc_server: LiveServer, extra: dict, param: str) -> None:
    r = _post(kvc_server, {"model": kvc_server.model, "prompt": "Hi", "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "BadRequestError"
    assert httpx.get(kvc_server.url + "/health", timeout=5).status_code == 200


def test_server_without_kvc_refuses_the_fields(server: LiveServer) -> None:
    r = _post(server, {"model": server.model, "prompt": "Hi", "max_tokens": 2,
                       "max_cache_tokens": 16})  # fmt: skip
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "max_cache_tokens"
    assert "enable-kvc" in r.json()["error"]["message"]
