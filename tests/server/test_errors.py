"""Every kind of bad input gets the right status and OpenAI's error body; the server stays up."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.server.conftest import LiveServer

CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "Hi"}]
LONG_TEXT = "hello " * 600  # > max_model_len (512) tokens

# (route, body (dict, or raw str for malformed JSON), status, param or None)
CASES: list[tuple[str, Any, int, str | None]] = [
    (CMPL, '{"prompt": "Hi",', 400, None),  # malformed JSON
    (CMPL, "[1, 2]", 400, None),  # not an object
    (CMPL, {"max_tokens": 4}, 400, "prompt"),  # missing field
    (CHAT, {"max_tokens": 4}, 400, "messages"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": [{"content": "Hi"}]}, 400, "messages.0.role"),
    (CMPL, {"prompt": "Hi", "temperature": "hot"}, 400, "temperature"),  # wrong types
    (CMPL, {"prompt": "Hi", "max_tokens": "many"}, 400, "max_tokens"),
    (CMPL, {"prompt": {"text": "Hi"}}, 400, "prompt"),
    (CMPL, {"prompt": "Hi", "stop": 5}, 400, "stop"),
    (CMPL, {"prompt": "Hi", "stop": [f"s{i}" for i in range(100_000)]}, 400, "stop"),  # bounds
    (CMPL, {"prompt": "Hi", "stop": ["x" * 5000]}, 400, "stop"),
    (CMPL, '{"prompt": "Hi", "temperature": Infinity}', 400, "temperature"),  # non-finite
    (CMPL, '{"prompt": "Hi", "top_p": NaN}', 400, "top_p"),
    (CMPL, {"prompt": "Hi", "temperature": -1}, 400, "temperature"),  # out of range
    (CMPL, {"prompt": "Hi", "top_p": 0}, 400, "top_p"),
    (CMPL, {"prompt": "Hi", "top_p": 1.5}, 400, "top_p"),
    (CMPL, {"prompt": "Hi", "max_tokens": 0}, 400, "max_tokens"),
    (CMPL, {"prompt": "Hi", "presence_penalty": 3}, 400, "presence_penalty"),
    (CMPL, {"prompt": "Hi", "frequency_penalty": -3}, 400, "frequency_penalty"),
    (CMPL, {"prompt": "Hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    (CMPL, {"prompt": "Hi", "top_k": -5}, 400, "top_k"),
    (CMPL, {"prompt": "Hi", "min_p": 2}, 400, "min_p"),
    (CMPL, {"prompt": "Hi", "logprobs": 50}, 400, "logprobs"),
    (CMPL, {"prompt": "Hi", "seed": 2**70}, 400, "seed"),
    (CMPL, {"prompt": "Hi", "min_tokens": 9, "max_tokens": 3}, 400, "min_tokens"),
    (CMPL, {"prompt": "Hi", "n": 0}, 400, "n"),  # parallel sampling and beam search
    (CHAT, {"messages": MSGS, "n": 1000}, 400, "n"),
    (CMPL, {"prompt": "Hi", "n": 3, "best_of": 2}, 400, "best_of"),
    (CMPL, {"prompt": "Hi", "best_of": 2, "temperature": 0}, 400, "best_of"),
    (CMPL, {"prompt": "Hi", "n": 2, "best_of": 3, "stream": True}, 400, "best_of"),
    (CHAT, {"messages": MSGS, "n": 2, "use_beam_search": True, "stream": True}, 400, "stream"),
    (CHAT, {"messages": MSGS, "use_beam_search": True, "logprobs": True}, 400, "logprobs"),
    (CMPL, {"prompt": "Hi", "use_beam_search": True, "length_penalty": "x"}, 400, "length_penalty"),
    (CHAT, {"messages": MSGS, "response_format": {"type": "yaml"}}, 400, "response_format"),
    (CMPL, {"prompt": "Hi", "guided_choice": "a"}, 400, "guided_choice"),
    (CMPL, {"prompt": "Hi", "cache_salt": 5}, 400, "cache_salt"),  # cache_salt, priority
    (CMPL, {"prompt": "Hi", "priority": "high"}, 400, "priority"),
    (CHAT, {"messages": MSGS, "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {"messages": MSGS, "top_logprobs": 21, "logprobs": True}, 400, "top_logprobs"),
    (CMPL, {"prompt": "Hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (CMPL, {"prompt": ""}, 400, "prompt"),  # empty prompts
    (CMPL, {"prompt": []}, 400, "prompt"),
    (CMPL, {"prompt": [10**9]}, 400, "prompt"),  # token id out of vocabulary
    (CMPL, {"prompt": LONG_TEXT}, 400, "prompt"),  # longer than the context
    (CMPL, {"prompt": "Hi", "max_tokens": 600}, 400, "prompt"),  # prompt + max_tokens too long
    (CHAT, {"messages": [{"role": "user", "content": LONG_TEXT}]}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages"),
    (CMPL, {"prompt": "Hi", "model": "gpt-4"}, 404, "model"),  # unknown model
    (CHAT, {"messages": MSGS, "model": "gpt-4"}, 404, "model"),
    ("/v1/nope", {}, 404, None),  # unknown route
]


def _post(server: LiveServer, route: str, body: Any, **kw: Any) -> httpx.Response:
    kw.setdefault("headers", server.headers)
    if isinstance(body, str):
        return httpx.post(server.url + route, content=body, timeout=30, **kw)
    return httpx.post(server.url + route, json=body, timeout=30, **kw)


def _check_error(r: httpx.Response, status: int, param: str | None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str)
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize("route,body,status,param", CASES)
def test_bad_input(server: LiveServer, route: str, body: Any, status: int, param: str) -> None:
    _check_error(_post(server, route, body), status, param)
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_messages_are_clear(server: LiveServer) -> None:
    err = _check_error(_post(server, CMPL, {"prompt": "Hi", "model": "x"}), 404, "model")
    assert err["message"] == "The model `x` does not exist."
    err = _check_error(_post(server, CMPL, {"prompt": "Hi", "n": 2, "best_of": 1}), 400, "best_of")
    assert "best_of must be an integer >= n (2)" in err["message"]
    body = {"prompt": "Hi", "use_beam_search": True, "temperature": 1}
    err = _check_error(_post(server, CMPL, body), 400, "temperature")
    assert "not supported with use_beam_search" in err["message"]
    err = _check_error(_post(server, CMPL, {"prompt": LONG_TEXT}), 400, "prompt")
    assert "maximum context length is 512 tokens" in err["message"]
    body = {"prompt": "Hi", "stop": [f"s{i}" for i in range(100_000)]}
    err = _check_error(_post(server, CMPL, body), 400, "stop")
    assert "at most 64 strings" in err["message"] and len(err["message"]) < 400


def test_api_key_required_on_v1(server: LiveServer) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": server.api_key}):
        r = _post(server, CMPL, {"prompt": "Hi", "max_tokens": 1}, headers=headers)
        _check_error(r, 401, None)
        assert httpx.get(f"{server.url}/v1/models", headers=headers).status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200  # not under /v1: open
    assert httpx.get(f"{server.url}/metrics").status_code == 200


def test_unknown_fields_are_ignored(server: LiveServer) -> None:
    body = {"prompt": "Hi", "max_tokens": 2, "no_such_field": 1, "store": True}
    r = _post(server, CMPL, body)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None


def test_openai_client_raises_typed_errors(server: LiveServer, client) -> None:  # noqa: ANN001
    import openai

    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="Hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=server.model, prompt="Hi", temperature=-2)
    assert info.value.body["param"] == "temperature"
    bad = server.client(api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    # Still serving after all of the above.
    ok = client.completions.create(model=server.model, prompt="Hi", max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")
