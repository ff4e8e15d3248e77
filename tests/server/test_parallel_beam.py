"""Parallel sampling (n, best_of) and beam search over HTTP, on the default model."""

from __future__ import annotations

from collections import defaultdict

import httpx
import openai
import pytest

from tests.server.conftest import LiveServer

PROMPT = "Once upon a time"
CHAT = [{"role": "user", "content": "Tell me a joke."}]


def _sampled(server: LiveServer, **kw: object) -> dict[str, object]:
    args: dict[str, object] = dict(model=server.model, max_tokens=10, temperature=1.0, seed=7)
    args.update(kw)
    return args


def test_n_choices_usage_and_streaming(server: LiveServer, client) -> None:  # noqa: ANN001
    """n=3: three indexed choices; usage counts the prompt once and every choice's tokens; the
    stream interleaves the same three texts (seeded), each with its own finish_reason."""
    before = server.metric("vllm:generation_tokens_total")
    full = client.completions.create(**_sampled(server, prompt=PROMPT, n=3))
    assert [c.index for c in full.choices] == [0, 1, 2]
    assert len({c.text for c in full.choices}) > 1  # seed + i per sequence: they differ
    assert all(c.finish_reason in ("stop", "length") for c in full.choices)
    n_prompt = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT}).json()["count"]
    assert full.usage.prompt_tokens == n_prompt
    assert server.metric("vllm:generation_tokens_total") - before == full.usage.completion_tokens
    assert full.usage.completion_tokens > 10  # more than one choice's worth

    stream = client.completions.create(
        **_sampled(server, prompt=PROMPT, n=3), stream=True, stream_options={"include_usage": True}
    )
    texts: dict[int, str] = defaultdict(str)
    finish: dict[int, list[str | None]] = defaultdict(list)
    chunks = list(stream)
    for chunk in chunks:
        assert len(chunk.choices) <= 1
        for c in chunk.choices:
            texts[c.index] += c.text
            finish[c.index].append(c.finish_reason)
    assert sorted(texts) == [0, 1, 2]
    assert [texts[i] for i in range(3)] == [c.text for c in full.choices]
    for i in range(3):  # each choice ends once, in its last chunk
        assert finish[i][-1] == full.choices[i].finish_reason
        assert all(f is None for f in finish[i][:-1])
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    server.wait_idle()


def test_n_with_several_prompts(server: LiveServer, client) -> None:  # noqa: ANN001
    out = client.completions.create(
        model=server.model, prompt=[PROMPT, "1, 2, 3,"], n=2, max_tokens=4, temperature=0
    )
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.choices[0].text == out.choices[1].text  # greedy: the n sequences agree
    assert out.choices[2].text == out.choices[3].text


def test_best_of(server: LiveServer, client) -> None:  # noqa: ANN001
    out = client.completions.create(**_sampled(server, prompt=PROMPT, n=2, best_of=4))
    assert [c.index for c in out.choices] == [0, 1]
    assert all(c.logprobs is None for c in out.choices)  # ranked by logprob, not shown
    assert 0 < out.usage.completion_tokens <= 20  # the two returned choices only
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**_sampled(server, prompt=PROMPT, n=1, best_of=2), stream=True)
    assert info.value.body["param"] == "best_of"


def test_chat_n_streaming(server: LiveServer, client) -> None:  # noqa: ANN001
    kw = _sampled(server, messages=CHAT, n=2)
    full = client.chat.completions.create(**kw)
    assert [c.index for c in full.choices] == [0, 1]
    assert all(c.message.role == "assistant" for c in full.choices)
    roles: dict[int, str | None] = {}
    texts: dict[int, str] = defaultdict(str)
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            roles.setdefault(c.index, c.delta.role)  # the first chunk of each choice
            texts[c.index] += c.delta.content or ""
    assert roles == {0: "assistant", 1: "assistant"}
    assert [texts[0], texts[1]] == [c.message.content for c in full.choices]


def test_beam_search(server: LiveServer, client) -> None:  # noqa: ANN001
    """use_beam_search: n hypotheses, distinct, deterministic; ``best_of`` widens the beam."""
    kw = dict(model=server.model, prompt=PROMPT, max_tokens=6, n=3)
    extra = {"use_beam_search": True, "ignore_eos": True}
    out = client.completions.create(**kw, extra_body=extra)
    texts = [c.text for c in out.choices]
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert len(set(texts)) == 3 and all(c.finish_reason == "length" for c in out.choices)
    assert out.usage.completion_tokens == 18
    again = client.completions.create(**kw, extra_body={**extra, "length_penalty": 1.0})
    assert [c.text for c in again.choices] == texts
    wide = client.completions.create(**{**kw, "n": 1}, extra_body={**extra, "best_of": 3})
    assert [c.text for c in wide.choices] == texts[:1]  # the best of the width-3 search

    chat = client.chat.completions.create(
        model=server.model, messages=CHAT, max_tokens=6, n=2,
        extra_body={"use_beam_search": True, "early_stopping": True},
    )  # fmt: skip
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content != chat.choices[1].message.content
    server.wait_idle()


@pytest.mark.parametrize(
    "body, param",
    [
        ({"stream": True}, "stream"),
        ({"logprobs": 2}, "logprobs"),
        ({"temperature": 0.8}, "temperature"),
        ({"stop": ["x"]}, "stop"),
        ({"guided_regex": "[ab]+"}, "guided_regex"),
        ({"cache_salt": "t1"}, "cache_salt"),
        ({"early_stopping": "sometimes"}, "early_stopping"),
    ],
)
def test_beam_search_rejects(server: LiveServer, body: dict, param: str) -> None:
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 4, "n": 2, "use_beam_search": True, **body},
        headers=server.headers,
        timeout=30,
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
