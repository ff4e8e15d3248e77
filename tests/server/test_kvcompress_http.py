"""KV-Compress over HTTP: the per-request fields work on a server started with --enable-kvc,
bad values are 400s naming the field, a server without it refuses them, and the server stays
healthy with every block free afterwards. The dashboard, in headless Chromium, shows a
KV-Compress request and a shared prefix as they run (this server has both: one start)."""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import ROOT, LiveServer, live_server

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


def _chromium() -> str | None:
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser")) if p), None)


def test_dashboard_in_a_browser(kvc_server: LiveServer) -> None:
    """Open /dashboard in headless Chromium (the key typed once into its form: a cookie),
    run two requests sharing a prefix and a KV-Compress one, and read from the DOM that the
    block map, the per-head heat map, the request table and the counters follow them. A
    screenshot taken mid-run lands in $PAGEDLLM_TEST_ARTIFACTS (default .test-artifacts/)."""
    sync_api = pytest.importorskip("playwright.sync_api")
    chromium = _chromium()
    if chromium is None:
        pytest.skip("no chromium (scripts/test.sh installs Debian's package where it can)")
    artifacts = Path(os.environ.get("PAGEDLLM_TEST_ARTIFACTS", ROOT / ".test-artifacts"))
    artifacts.mkdir(parents=True, exist_ok=True)
    srv = kvc_server
    srv.wait_idle()
    prefix = "Our ship log, day one: the sea was calm and the wind came from the west. " * 14
    bodies = [{"model": srv.model, "prompt": prefix + f"Entry {i}:", "max_tokens": 64,
               "ignore_eos": True, "temperature": 0} for i in range(2)]  # fmt: skip
    bodies.append({**bodies[0], "prompt": "A different story. " * 50, "compression_rate": 4})
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1500})
            page.goto(f"{srv.url}/dashboard")
            page.wait_for_function("document.body.dataset.state === 'login'", timeout=30_000)
            page.fill("#key", "not the key")
            page.click("#login button")
            page.wait_for_function("document.getElementById('login-error').textContent !== ''")
            page.fill("#key", srv.api_key)
            page.click("#login button")
            page.wait_for_function("document.body.dataset.state === 'live'", timeout=30_000)

            def read() -> dict:
                return page.evaluate("""() => ({
                    map: {...document.getElementById('blockmap').dataset},
                    heads: {...document.getElementById('heatmap').dataset},
                    rows: document.querySelectorAll('#requests tbody tr').length,
                    hits: +document.getElementById('t-prefix-hit').dataset.value || 0,
                    evicted: +document.getElementById('t-evicted').dataset.value || 0,
                    updates: +document.getElementById('updates').textContent})""")

            before = read()
            assert before["map"]["used"] == before["map"]["shared"] == "0"
            assert int(before["map"]["total"]) > 0
            first = httpx.post(srv.url + CMPL, json={**bodies[0], "max_tokens": 1},
                               headers=srv.headers, timeout=300)  # fmt: skip
            assert first.status_code == 200  # its prefix is now in the cache
            threads = [threading.Thread(target=httpx.post, args=(srv.url + CMPL,),
                                        kwargs={"json": b, "headers": srv.headers,
                                                "timeout": 300}) for b in bodies]  # fmt: skip
            for t in threads:
                t.start()
            # mid-run: blocks held (the prefix by two requests), the compressed request's
            # heads on the heat map with KVs evicted, the requests in the table
            page.wait_for_function("""() => {
                const m = document.getElementById('blockmap').dataset;
                const h = document.getElementById('heatmap').dataset;
                return +m.shared > 0 && +m.used > 0 && +h.requests > 0 && +h.keptMean < 0.9
                    && document.querySelectorAll('#requests tbody tr').length >= 2; }""",
                                   timeout=120_000)  # fmt: skip
            during = read()
            page.screenshot(path=str(artifacts / "dashboard.png"), full_page=True)
            assert page.locator("#requests tbody tr td", has_text="4x").count() == 1
            for t in threads:
                t.join()
            # after: nothing held, the prompts' blocks cached, the counters moved
            page.wait_for_function("""() => {
                const m = document.getElementById('blockmap').dataset;
                return m.used === '0' && m.shared === '0'
                    && document.querySelectorAll('#requests tbody tr').length === 0; }""",
                                   timeout=60_000)  # fmt: skip
            after = read()
        finally:
            browser.close()
    assert int(after["map"]["cached"]) > int(before["map"]["cached"])
    assert after["hits"] > before["hits"] and after["evicted"] > before["evicted"]
    assert float(during["heads"]["keptMean"]) < 0.9 and after["updates"] > during["updates"]
    assert (artifacts / "dashboard.png").stat().st_size > 10_000
    srv.wait_idle()
