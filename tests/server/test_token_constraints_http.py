"""logit_bias (OpenAI's), allowed_token_ids and bad_words (vLLM's extras) over HTTP, on the
default model; bad values are 400s naming the field."""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest

from tests.server.conftest import LiveServer

PROMPT = "The capital of France is"


def _ids(server: LiveServer, text: str) -> list[int]:
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": text, "add_special_tokens": False})
    return r.json()["tokens"]


def _text(server: LiveServer, ids: list[int]) -> str:
    return httpx.post(f"{server.url}/detokenize", json={"tokens": ids}).json()["prompt"]


def test_logit_bias_100_gives_that_token_every_time(server: LiveServer, client) -> None:  # noqa: ANN001
    (tid,) = _ids(server, " blue")
    out = client.completions.create(
        model=server.model,
        prompt=PROMPT,
        max_tokens=8,
        temperature=1.0,
        n=3,
        logit_bias={str(tid): 100},
        extra_body={"ignore_eos": True},
    )
    want = _text(server, [tid] * 8)
    assert [c.text for c in out.choices] == [want] * 3
    chat = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=5,
        temperature=1.0,
        logit_bias={str(tid): 100},
        extra_body={"ignore_eos": True},
    )
    assert chat.choices[0].message.content == _text(server, [tid] * 5)


def test_bad_words_keep_a_word_out(server: LiveServer, client) -> None:  # noqa: ANN001
    kw = dict(model=server.model, prompt=PROMPT, max_tokens=8, temperature=0)
    assert "Paris" in client.completions.create(**kw).choices[0].text  # (so this can fail)
    out = client.completions.create(**kw, extra_body={"bad_words": ["Paris"]})
    assert "Paris" not in out.choices[0].text and out.choices[0].text


def test_allowed_token_ids_bound_the_output(server: LiveServer, client) -> None:  # noqa: ANN001
    (yes,), (no,) = _ids(server, " yes"), _ids(server, " no")
    out = client.completions.create(
        model=server.model,
        prompt=PROMPT,
        max_tokens=6,
        temperature=1.0,
        n=2,
        extra_body={"allowed_token_ids": [yes, no], "ignore_eos": True},
    )
    for c in out.choices:
        assert re.fullmatch(r"( yes| no){6}", c.text), c.text


CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize(
    "route,body,param",
    [
        (CMPL, {"prompt": "Hi", "logit_bias": {"abc": 5}}, "logit_bias"),  # not an int key
        (CHAT, {"messages": MSGS, "logit_bias": {"1.5": 5}}, "logit_bias"),
        (CMPL, {"prompt": "Hi", "logit_bias": {"-3": 5}}, "logit_bias"),
        (CMPL, {"prompt": "Hi", "logit_bias": {"99999999": 5}}, "logit_bias"),  # vocabulary
        (CMPL, {"prompt": "Hi", "logit_bias": {"5": 101}}, "logit_bias"),  # range
        (CMPL, {"prompt": "Hi", "logit_bias": {str(i): 1 for i in range(2000)}}, "logit_bias"),
        (CMPL, {"prompt": "Hi", "allowed_token_ids": []}, "allowed_token_ids"),
        (CMPL, {"prompt": "Hi", "allowed_token_ids": [1, 10**9]}, "allowed_token_ids"),
        (CHAT, {"messages": MSGS, "bad_words": ["x" * 2000]}, "bad_words"),
        (CMPL, {"prompt": "Hi", "bad_words": [" "]}, "bad_words"),
        (CMPL, {"prompt": "Hi", "use_beam_search": True, "logit_bias": {"5": 1}}, "logit_bias"),
    ],
)
def test_bad_values_are_400s_naming_the_field(
    server: LiveServer, route: str, body: dict[str, Any], param: str
) -> None:
    r = httpx.post(server.url + route, json=body, headers=server.headers, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == 400, err
    assert err["message"].startswith(param) or param in err["message"], err
