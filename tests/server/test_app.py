"""``build_app`` in-process (ASGI transport, tiny random model): chat-template override, API key
from the environment, tokenize/detokenize, model card."""

from __future__ import annotations

import asyncio
import json
import re
from argparse import Namespace
from collections.abc import Iterator

import httpx
import pytest

from pagedllm.engine.async_llm import AsyncLLM, merge_deltas
from pagedllm.entrypoints.openai.server import build_app
from pagedllm.outputs import CompletionOutput, RequestOutput
from tests.server.conftest import asgi_call, tiny_async_llm

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def llm(tiny_models) -> Iterator[AsyncLLM]:  # noqa: ANN001
    with tiny_async_llm(tiny_models("llama")) as engine:
        yield engine


_call = asgi_call


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
    # the hot endpoints (hot_path.HotRoutes) sit inside the key check too
    for path in ("/v1/chat/completions", "/v1/completions"):
        r = _call(app, "POST", path, json={**body, "prompt": "Hi"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
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


def test_priority_and_cache_salt_reach_the_engine(llm: AsyncLLM, monkeypatch) -> None:  # noqa: ANN001
    """The body's ``priority`` and ``cache_salt`` arrive on the engine's Request (as the
    scheduler sees it when the request is queued), for completions and chat."""
    seen: list[tuple[int, str | None, list[int]]] = []
    core = llm.engine.engine_core
    orig = core.add_request

    def spy(request):  # noqa: ANN001, ANN202 - runs on the engine thread
        seen.append((request.priority, request.cache_salt, list(request.prompt_token_ids)))
        return orig(request)

    monkeypatch.setattr(core, "add_request", spy)
    app = build_app(llm, Namespace(chat_template=TEMPLATE))
    body = {"prompt": [5, 6, 7], "max_tokens": 2, "priority": -3, "cache_salt": "tenant-1"}
    assert _call(app, "POST", "/v1/completions", json=body).status_code == 200
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "priority": 2}
    assert _call(app, "POST", "/v1/chat/completions", json=chat).status_code == 200
    assert _call(app, "POST", "/v1/completions", json={"prompt": [5], "max_tokens": 1}).is_success
    assert [(p, s) for p, s, _ in seen] == [(-3, "tenant-1"), (2, None), (0, None)]
    assert seen[0][2] == [5, 6, 7]
    r = _call(app, "POST", "/v1/completions", json={**body, "cache_salt": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_grammar_compiles_off_the_loop_and_engine_thread(llm: AsyncLLM, monkeypatch) -> None:  # noqa: ANN001
    """build_app creates the grammar manager on a helper thread; each request's grammar is
    compiled on an executor thread, never on the event loop's nor the engine's."""
    pytest.importorskip("xgrammar")
    import threading

    threads: list[str] = []
    engine = llm.engine
    orig = engine.check_structured_outputs

    def spy(params):  # noqa: ANN001, ANN202
        threads.append(threading.current_thread().name)
        return orig(params)

    monkeypatch.setattr(engine, "check_structured_outputs", spy)
    app = build_app(llm, Namespace())
    assert llm.prepare_structured_outputs().result(timeout=60) is not None
    body = {"prompt": "x", "max_tokens": 3, "temperature": 0, "guided_choice": ["yes", "no"]}
    r = _call(app, "POST", "/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("yes", "no")
    r = _call(
        app, "POST", "/v1/completions", json={**body, "guided_regex": "(", "guided_choice": None}
    )
    assert r.status_code == 400 and "invalid regex" in r.json()["error"]["message"]
    assert len(threads) == 2
    assert all(t not in ("MainThread", "pagedllm-engine") for t in threads), threads


def test_sequences_must_fit_one_batch(tiny_models) -> None:  # noqa: ANN001
    """n, best_of and the beam width may not exceed --max-num-seqs (the engine runs a
    request's sequences in one batch): a 400, not a failed engine step."""
    from pagedllm.config import EngineArgs

    args = EngineArgs(model=tiny_models("llama"), dtype="float32", max_model_len=64,
                      num_gpu_blocks_override=16, device="cpu", max_num_seqs=2)  # fmt: skip
    small = AsyncLLM.from_engine_args(args)
    try:
        app = build_app(small, Namespace(chat_template=TEMPLATE))
        base = {"prompt": [5, 6], "max_tokens": 2}
        for extra, param in (
            ({"n": 3}, "n"),
            ({"n": 2, "best_of": 3, "temperature": 1.0}, "best_of"),
            ({"n": 3, "use_beam_search": True}, "n"),
        ):
            r = _call(app, "POST", "/v1/completions", json={**base, **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
            assert "max_num_seqs (2)" in r.json()["error"]["message"]
        msgs = [{"role": "user", "content": "Hi"}]
        r = _call(app, "POST", "/v1/chat/completions", json={"messages": msgs, "n": 3})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
        r = _call(app, "POST", "/v1/completions", json={**base, "n": 2, "temperature": 1.0})
        assert r.status_code == 200 and len(r.json()["choices"]) == 2
    finally:
        small.shutdown()


def test_small_hardening(llm: AsyncLLM, monkeypatch) -> None:  # noqa: ANN001
    """Non-finite numbers and empty tokenize messages are 400s naming the field; 405 says
    what is allowed; the model card names the model, not its path; a counter that has not
    moved has a value (0), not only its HELP and TYPE lines."""
    monkeypatch.delenv("PAGEDLLM_API_KEY", raising=False)
    app = build_app(llm, Namespace(served_model_name="tiny-m"))
    card = _call(app, "GET", "/v1/models").json()["data"][0]
    assert card["root"] == "tiny-m" and card["id"] == "tiny-m"
    r = _call(app, "POST", "/tokenize", json={"messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    bad = (("temperature", "Infinity"), ("top_p", "NaN"), ("temperature", "-Infinity"))
    for field, value in bad:
        body = f'{{"prompt": "Hi", "max_tokens": 2, "{field}": {value}}}'
        r = _call(app, "POST", "/v1/completions", content=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    r = _call(app, "GET", "/v1/completions")
    assert r.status_code == 405 and "POST" in r.headers["allow"]
    assert r.json()["error"]["type"] == "MethodNotAllowed"
    text = _call(app, "GET", "/metrics").text
    assert 'vllm:num_preemptions_total{model_name="tiny-m"} 0.0' in text
    assert 'vllm:request_success_total{finished_reason="abort",model_name="tiny-m"}' in text


def test_huge_prompts_and_bodies_are_refused_early(llm: AsyncLLM, monkeypatch) -> None:  # noqa: ANN001
    """A prompt with more characters than the context can hold is a 400 before tokenizing
    (completions, chat, /tokenize); a body over --max-request-body-bytes is a 413 with
    OpenAI's error body; a normal request still works after them."""
    monkeypatch.delenv("PAGEDLLM_API_KEY", raising=False)
    app = build_app(llm, Namespace(served_model_name="tiny-m", max_request_body_bytes=300_000))
    huge = "a" * 200_000  # max_model_len 128: far more characters than 128 tokens hold
    r = _call(app, "POST", "/v1/completions", json={"prompt": huge, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert "characters" in r.json()["error"]["message"]
    chat = {"messages": [{"role": "user", "content": huge}], "max_tokens": 2}
    r = _call(app, "POST", "/v1/chat/completions", json=chat)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    r = _call(app, "POST", "/tokenize", json={"prompt": huge})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    r = _call(app, "POST", "/v1/completions", json={"prompt": "a" * 400_000})
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert err["code"] == 413 and err["type"] == "RequestEntityTooLarge"
    r = _call(app, "POST", "/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 1


def test_openapi_documents_bodies_and_responses(llm: AsyncLLM, monkeypatch) -> None:  # noqa: ANN001
    """/openapi.json names each POST route's request body and every route's responses; the
    response models match what the server really sends (validated against live answers)."""
    from pagedllm.entrypoints.openai import openapi

    monkeypatch.delenv("PAGEDLLM_API_KEY", raising=False)
    app = build_app(llm, Namespace(served_model_name="tiny-m", chat_template=TEMPLATE))
    doc = _call(app, "GET", "/openapi.json").json()
    schemas = doc["components"]["schemas"]
    bodies = {"/v1/completions": "CompletionRequest", "/v1/chat/completions":
              "ChatCompletionRequest", "/tokenize": "TokenizeRequest",
              "/detokenize": "DetokenizeRequest"}  # fmt: skip
    for path, name in bodies.items():
        op = doc["paths"][path]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{name}"
        assert ref.split("/")[-1] in schemas
        for code in ("200", "400", "413", "500", "503"):
            assert code in op["responses"], (path, code)
        assert op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith(
            "/ErrorResponse")  # fmt: skip
    props = schemas["CompletionRequest"]["properties"]
    assert {"prompt", "max_tokens", "temperature", "stream", "logprobs"} <= set(props)
    assert "messages" in schemas["ChatCompletionRequest"]["properties"]
    ok = doc["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]
    assert ok["application/json"]["schema"]["$ref"].endswith("/CompletionResponse")
    assert "text/event-stream" in ok
    assert doc["paths"]["/v1/models"]["get"]["responses"]["200"]["content"]
    # every $ref resolves
    refs = set(re.findall(r"#/components/schemas/([A-Za-z0-9_.-]+)", json.dumps(doc)))
    assert refs and refs <= set(schemas), refs - set(schemas)
    # the documented shapes are the real ones
    r = _call(
        app,
        "POST",
        "/v1/completions",
        json={"prompt": "Hi", "max_tokens": 3, "logprobs": 2, "n": 2, "temperature": 1},
    )
    openapi.CompletionResponse.model_validate(r.json(), strict=False)
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "logprobs": True,
            "top_logprobs": 2}  # fmt: skip
    openapi.ChatCompletionResponse.model_validate(
        _call(app, "POST", "/v1/chat/completions", json=chat).json()
    )
    r = _call(app, "POST", "/v1/chat/completions", json={**chat, "stream": True})
    events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: {")]
    assert events
    for e in events:
        openapi.ChatCompletionChunk.model_validate_json(e)
    openapi.ModelList.model_validate(_call(app, "GET", "/v1/models").json())
    tok = _call(app, "POST", "/tokenize", json={"prompt": "Hi", "return_token_strs": True})
    openapi.TokenizeResponse.model_validate(tok.json())
    detok = _call(app, "POST", "/detokenize", json={"tokens": tok.json()["tokens"]})
    openapi.DetokenizeResponse.model_validate(detok.json())


def test_return_token_ids_streamed_and_not(llm: AsyncLLM) -> None:
    """vLLM's ``return_token_ids``: a streamed reply's chunks add up to the non-streamed
    reply's token ids, and the prompt's ids come with it (completions and chat)."""
    app = build_app(llm)
    comp = {"prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True}  # fmt: skip

    async def run() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            for path, body in (("/v1/completions", comp), ("/v1/chat/completions", chat)):
                whole = (await c.post(path, json=body)).json()
                ids = whole["choices"][0]["token_ids"]
                prompt = whole.get("prompt_token_ids") or whole["choices"][0][
                    "prompt_token_ids"]  # fmt: skip
                assert len(ids) == 6 and prompt
                got, got_prompt = [], None
                text = (await c.post(path, json={**body, "stream": True})).text
                for line in text.splitlines():
                    if line.startswith("data: {"):
                        d = json.loads(line[6:])
                        got_prompt = got_prompt or d.get("prompt_token_ids") or next(
                            (ch.get("prompt_token_ids") for ch in d["choices"]), None)
                        for ch in d["choices"]:
                            got += ch.get("token_ids", [])
                assert got == ids and got_prompt == prompt, path

    asyncio.run(run())
