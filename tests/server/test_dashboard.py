"""The dashboard's routes in-process (``build_app`` over a tiny random model): the page and its
files are served from the package, ``/dashboard/state`` is the documented JSON, the API key
guards the dashboard's data (bearer, or the cookie its login sets), ``--no-dashboard`` removes
them, the event stream pushes states, and bad settings are refused. The page itself, in a browser
against a live KV-Compress server, is tested in ``test_kvcompress_http.py``."""

from __future__ import annotations

import asyncio
import json
import time
from argparse import Namespace
from collections.abc import Iterator
from typing import Any

import pytest

from pagedllm.dashboard.service import DashboardService, to_json
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.server import build_app
from tests.server.conftest import asgi_call, tiny_async_llm


@pytest.fixture(scope="module")
def llm(tiny_models) -> Iterator[AsyncLLM]:  # noqa: ANN001
    with tiny_async_llm(tiny_models("llama")) as engine:
        yield engine


_call = asgi_call


def test_page_files_and_state(llm: AsyncLLM) -> None:
    app = build_app(llm, Namespace(served_model_name="tiny-m"))
    page = _call(app, "GET", "/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/dashboard/static/dashboard.js" in page.text
    js = _call(app, "GET", "/dashboard/static/dashboard.js")
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    assert "EventSource" in js.text
    assert _call(app, "GET", "/dashboard/static/dashboard.css").status_code == 200
    for bad in ("nope.js", "..%2Fservice.py", "__init__.py"):
        r = _call(app, "GET", f"/dashboard/static/{bad}")
        assert r.status_code == 404, bad
    r = _call(app, "POST", "/v1/completions", json={"model": "tiny-m", "prompt": [5] * 20,
                                                    "max_tokens": 4})  # fmt: skip
    assert r.status_code == 200
    state = _call(app, "GET", "/dashboard/state").json()
    assert state["model"] == "tiny-m" and state["version"] >= 1
    snap = state["snapshot"]
    blocks = snap["blocks"]
    assert blocks["total"] == 32 and sum(blocks["counts"].values()) == 32
    assert blocks["counts"]["cached"] >= 1  # the finished prompt's full blocks
    assert len(blocks["cells"]) == len(blocks["cell_owner"]) == 32
    assert snap["stats"]["num_steps"] >= 4 and snap["heads"] is None
    assert snap["requests"] == [] and snap["cores"] == 1 and snap["build_ms"] >= 0


def test_api_key_guards_the_dashboard_data(llm: AsyncLLM) -> None:
    """With a key: the state and the events need it (bearer, or the cookie ``/dashboard/login``
    sets for a right key); the page and its files hold no data and need none; a key in the
    URL is not accepted (access logs keep URLs)."""
    app = build_app(llm, Namespace(api_key="sekret"))
    for path in ("/dashboard", "/dashboard/static/dashboard.js"):
        assert _call(app, "GET", path).status_code == 200
    for path in ("/dashboard/state", "/dashboard/events"):
        r = _call(app, "GET", path)
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
        assert _call(app, "GET", path + "?api_key=sekret").status_code == 401
        bad_cookie = {"Cookie": "pagedllm_api_key=wrong"}
        assert _call(app, "GET", path, headers=bad_cookie).status_code == 401
    r = _call(app, "GET", "/dashboard/state", headers={"Authorization": "Bearer sekret"})
    assert r.status_code == 200
    for bad in ({"api_key": "wrong"}, {"api_key": 7}, {}, ["sekret"]):
        r = _call(app, "POST", "/dashboard/login", json=bad)
        assert r.status_code == 401 and "set-cookie" not in r.headers, bad
        assert r.json()["error"]["param"] == "api_key"
    r = _call(app, "POST", "/dashboard/login", content=b"not json")
    assert r.status_code == 401
    r = _call(app, "POST", "/dashboard/login", json={"api_key": "sekret"})
    assert r.status_code == 204
    cookie = r.headers["set-cookie"]
    assert "pagedllm_api_key=sekret" in cookie and "HttpOnly" in cookie
    assert "Path=/dashboard" in cookie and "SameSite=strict" in cookie
    r = _call(app, "GET", "/dashboard/state", headers={"Cookie": "pagedllm_api_key=sekret"})
    assert r.status_code == 200
    # a malformed cookie header is no key, not a crash
    r = _call(app, "GET", "/dashboard/state", headers={"Cookie": 'a="; pagedllm_api_key'})
    assert r.status_code == 401
    # the cookie opens the dashboard only, never the API
    r = _call(app, "GET", "/v1/models", headers={"Cookie": "pagedllm_api_key=sekret"})
    assert r.status_code == 401
    # without a key on the server, login is a no-op
    open_app = build_app(llm, Namespace())
    r = _call(open_app, "POST", "/dashboard/login", json={"api_key": "anything"})
    assert r.status_code == 204 and "set-cookie" not in r.headers


def test_no_dashboard_and_bad_rate(llm: AsyncLLM) -> None:
    app = build_app(llm, Namespace(dashboard=False))
    assert _call(app, "GET", "/dashboard").status_code == 404
    assert _call(app, "GET", "/dashboard/state").status_code == 404
    for bad in (0, -1.0, float("nan"), "2"):
        with pytest.raises(ValueError, match="dashboard_hz"):
            build_app(llm, Namespace(dashboard_hz=bad))


def test_event_stream_and_history(llm: AsyncLLM) -> None:
    """The stream's first event is a full state; the next ones come at the asked rate (capped
    at 4 a second) with only the history points since the last; the sampler's points turn
    counters into rates."""
    from pagedllm.metrics import ServerMetrics

    async def go() -> tuple[list[dict], list[dict]]:
        metrics = ServerMetrics("tiny-m")
        llm.stat_loggers.append(metrics.record)
        service = DashboardService(llm, metrics, hz=4.0)
        try:
            service.sample()
            params = __import__("pagedllm").SamplingParams(max_tokens=6, ignore_eos=True)
            async for _ in llm.generate({"prompt_token_ids": [5] * 20}, params, "dash-1"):
                pass
            await asyncio.sleep(0.05)
            service.sample()
            events = []
            gen = service.events(hz=100.0)  # asks for more than the cap
            t0 = asyncio.get_running_loop().time()
            async for chunk in gen:
                assert chunk.startswith(b"data: ") and chunk.endswith(b"\n\n")
                events.append(json.loads(chunk[6:]))
                if len(events) == 3:
                    break
            await gen.aclose()
            assert asyncio.get_running_loop().time() - t0 >= 0.45  # 2 periods of >= 0.25 s
            assert service.viewers == 0
            return events, list(service.history)
        finally:
            llm.stat_loggers.remove(metrics.record)
            await service.close()

    events, history = asyncio.run(go())
    assert len(events[0]["history"]) == 2 and events[1]["history"] == []
    assert events[0]["snapshot"]["stats"]["num_steps"] >= 6
    point = history[-1]
    assert point["gen_tok_s"] > 0 and point["steps_s"] > 0 and point["step_ms"] > 0
    assert history[0]["gen_tok_s"] is None  # no rate from a single sample


def test_slow_snapshots_slow_the_rate(llm: AsyncLLM) -> None:
    """A snapshot that took 10 ms is not asked again for 2 s (0.5% of the core's time), for
    any viewer or script; a 0.5 ms one only waits the 4 Hz period."""
    from pagedllm.dashboard.service import CORE_BUDGET
    from pagedllm.metrics import ServerMetrics

    service = DashboardService(llm, ServerMetrics("tiny-m"), hz=4.0)
    calls = []

    async def fake(fn: Any) -> list[dict]:
        calls.append(fn)
        return [{"build_ms": build_ms, "requests": []}]

    llm_calls = llm.call_in_cores
    llm.call_in_cores = fake  # type: ignore[method-assign]
    try:
        for build_ms, period in ((0.5, 0.25), (10.0, 10e-3 / CORE_BUDGET)):
            time.sleep(0.3)  # the last snapshot is older than 4 Hz's period
            calls.clear()
            snap = asyncio.run(service.snapshot(max_age=0))
            assert snap["build_ms"] == build_ms and service.min_period == pytest.approx(period)
            assert service.state(snap)["period_s"] == pytest.approx(period)
            asyncio.run(service.snapshot(max_age=0))  # within the period: the same one
            assert len(calls) == 1
    finally:
        llm.call_in_cores = llm_calls  # type: ignore[method-assign]


def test_non_finite_numbers_become_null() -> None:
    data = {"a": [1.5, float("nan")], "b": {"c": float("inf")}, "d": "x", "e": (2, -float("inf"))}
    assert json.loads(to_json(data)) == {"a": [1.5, None], "b": {"c": None}, "d": "x",
                                         "e": [2, None]}  # fmt: skip
    assert to_json({"a": 1}) == b'{"a":1}'


def test_a_failed_snapshot_is_an_event_not_the_end(llm: AsyncLLM) -> None:
    """When the engine cannot give a snapshot, the stream says so (``engine-error``) and stays
    open for the next one."""
    from pagedllm.metrics import ServerMetrics

    service = DashboardService(llm, ServerMetrics("tiny-m"), hz=4.0)

    async def broken(fn: Any) -> list[dict]:
        raise RuntimeError("the engine is gone")

    async def go() -> bytes:
        gen = service.events()
        try:
            return await gen.__anext__()
        finally:
            await gen.aclose()

    real = llm.call_in_cores
    llm.call_in_cores = broken  # type: ignore[method-assign]
    try:
        first = asyncio.run(go())
    finally:
        llm.call_in_cores = real  # type: ignore[method-assign]
    event, data = first.split(b"\n", 1)
    assert event == b"event: engine-error"
    assert json.loads(data.removeprefix(b"data: "))["error"] == "the engine is gone"
    assert service.viewers == 0
