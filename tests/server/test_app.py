"""``build_app`` in-process (ASGI transport, tiny random model): chat-template override, API key
from the environment, tokenize/detokenize, model card."""

from __future__ import annotations

import asyncio
from argparse import Namespace
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pagedllm.engine.async_llm import AsyncLLM, merge_deltas
from pagedllm.entrypoints.openai.server import build_app
from pagedllm.outputs import CompletionOutput, RequestOutput

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def llm(tiny_models) -> Iterator[AsyncLLM]:  # noqa: ANN001
    from pagedllm.config import EngineArgs

    args = EngineArgs(model=tiny_models("llama"), dtype="float32", max_model_len=128,
                      num_gpu_blocks_override=32, device="cpu")  # fmt: skip
    engine = AsyncLLM.from_engine_args(args)
    yield engine
    engine.shutdown()


def _call(app: Any, method: str, path: str, **kw: Any) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.request(method, path, **kw)

    return asyncio.run(go())


def test_chat_template_override_and_env_key(llm: AsyncLLM, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("PAGEDLLM_API_KEY", "envkey")
    app = build_app(llm, Namespace(served_model_name="tiny-m", chat_template=TEMPLATE))
    auth = {"Authorization": "Bearer envkey"}
    assert _call(app, "GET", "/v1/models").status_code == 401
    models = _call(app, "GET", "/v1/models", headers=auth).json()
    assert models["data"][0]["id"] == "tiny-m" and models["data"][0]["max_model_len"] == 128
    msgs = [{"role": "user", "content": "Hi"}]
    tok = _call(app, "POST", "/tokenize", json={"messages": msgs}).json()
    text = _call(app, "POST", "/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]
    assert text == "[user]Hi"
    body = {"model": "tiny-m", "messages": msgs, "max_tokens": 3, "temperature": 0}
    r = _call(app, "POST", "/v1/chat/completions", json=body, headers=auth)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == tok["count"]
    r = _call(app, "POST", "/detokenize", json={"tokens": [10**7]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


def test_bad_chat_template_is_a_400(llm: AsyncLLM) -> None:
    app = build_app(llm, Namespace(chat_template="{% if x %}{{ raise_exception('no') }}"))
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    r = _call(app, "POST", "/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert _call(app, "GET", "/health").status_code == 200


def test_merge_deltas() -> None:
    def out(text: str, ids: list[int], fin: str | None) -> RequestOutput:
        c = CompletionOutput(0, text, ids, None, None, fin)
        return RequestOutput("r", "p", [1], None, [c], fin is not None)

    m = merge_deltas(out("a", [1], None), out("bc", [2, 3], "stop"))
    assert (m.outputs[0].text, m.outputs[0].token_ids, m.finished) == ("abc", [1, 2, 3], True)
