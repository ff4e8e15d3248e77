"""The OpenAI-compatible API through the official ``openai`` client, on the default model."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import LiveServer

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]


def test_models_health_version(server: LiveServer, client) -> None:  # noqa: ANN001
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]


def test_completion_and_usage(server: LiveServer, client) -> None:  # noqa: ANN001
    out = client.completions.create(  # vLLM's extras go in extra_body
        model=server.model,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.object == "text_completion" and out.model == server.model
    choice = out.choices[0]
    assert choice.finish_reason == "length" and choice.text
    n_prompt = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT}).json()["count"]
    assert out.usage.prompt_tokens == n_prompt
    assert out.usage.completion_tokens == 8
    assert out.usage.total_tokens == n_prompt + 8


def test_chat(server: LiveServer, client) -> None:  # noqa: ANN001
    out = client.chat.completions.create(
        model=server.model, messages=CHAT, max_tokens=24, temperature=0
    )
    msg = out.choices[0].message
    assert out.object == "chat.completion"
    assert msg.role == "assistant" and msg.content.strip()
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.usage.completion_tokens <= 24 and out.usage.prompt_tokens > 10


def test_streaming_equals_non_streaming(server: LiveServer, client) -> None:  # noqa: ANN001
    kw = dict(model=server.model, prompt=PROMPT, max_tokens=16, temperature=0)
    full = client.completions.create(**kw)
    chunks = list(
        client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == full.choices[0].finish_reason and all(f is None for f in finals[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens
    assert all(c.usage is None for c in chunks[:-1])

    ckw = dict(model=server.model, messages=CHAT, max_tokens=16, temperature=0)
    chat_full = client.chat.completions.create(**ckw)
    chat_chunks = list(client.chat.completions.create(**ckw, stream=True))
    assert chat_chunks[0].choices[0].delta.role == "assistant"
    chat_text = "".join(c.choices[0].delta.content or "" for c in chat_chunks)
    assert chat_text == chat_full.choices[0].message.content
    assert chat_chunks[-1].choices[0].finish_reason == chat_full.choices[0].finish_reason


def test_streaming_raw_sse_ends_with_done(server: LiveServer) -> None:
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 3, "stream": True}
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=body, headers=server.headers
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"


def test_completion_logprobs(server: LiveServer, client) -> None:  # noqa: ANN001
    out = client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3
    )
    choice = out.choices[0]
    lp = choice.logprobs
    n = out.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for tok, tlp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert tlp <= 0.0
        assert 1 <= len(top) <= 4
        assert tok in top and top[tok] == pytest.approx(max(top.values()))  # greedy: the best

    echoed = client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=2, temperature=0, logprobs=1, echo=True
    )
    e = echoed.choices[0]
    assert e.text.startswith(PROMPT)
    assert e.logprobs.token_logprobs[0] is None and e.logprobs.top_logprobs[0] is None
    assert len(e.logprobs.tokens) == echoed.usage.prompt_tokens + echoed.usage.completion_tokens


def test_chat_logprobs(server: LiveServer, client) -> None:  # noqa: ANN001
    out = client.chat.completions.create(
        model=server.model, messages=CHAT, max_tokens=5, temperature=0, logprobs=True,
        top_logprobs=2,
    )  # fmt: skip
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob)  # greedy
        assert item.bytes == list(item.token.encode())
    streamed = client.chat.completions.create(
        model=server.model, messages=CHAT, max_tokens=5, temperature=0, logprobs=True,
        top_logprobs=2, stream=True,
    )  # fmt: skip
    tokens = [
        t.token for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.content
    ]
    assert tokens == [item.token for item in content]


def test_stop_strings(server: LiveServer, client) -> None:  # noqa: ANN001
    kw = dict(model=server.model, prompt=PROMPT, max_tokens=16, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    words = full.split()
    assert len(words) >= 3, full
    stop = " " + words[2]
    cut = client.completions.create(**kw, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.model_extra["stop_reason"] == stop
    assert cut.text == full[: full.index(stop)]
    kept = client.completions.create(
        **kw, stop=stop, extra_body={"include_stop_str_in_output": True}
    ).choices[0]
    assert kept.text == full[: full.index(stop) + len(stop)]
    streamed = client.completions.create(**kw, stop=[stop], stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut.text


def test_seed_reproducible(server: LiveServer, client) -> None:  # noqa: ANN001
    def sample(seed: int) -> str:
        return client.completions.create(
            model=server.model, prompt="Once upon a time", max_tokens=12, temperature=1.0,
            seed=seed, extra_body={"ignore_eos": True},
        ).choices[0].text  # fmt: skip

    first = sample(1234)
    assert sample(1234) == first
    assert len({first, sample(1), sample(2)}) > 1


def test_multiple_prompts_and_token_ids(server: LiveServer, client) -> None:  # noqa: ANN001
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    out = client.completions.create(
        model=server.model, prompt=[PROMPT, "1, 2, 3,"], max_tokens=4, temperature=0
    )
    assert [c.index for c in out.choices] == [0, 1]
    by_ids = client.completions.create(model=server.model, prompt=ids, max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == out.choices[0].text
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": ids}).json()["prompt"]
    assert text == PROMPT


def test_metrics_rise(server: LiveServer, client) -> None:  # noqa: ANN001
    before = server.metrics()
    out = client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=5, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    after = server.metrics()

    def delta(name: str) -> float:
        key = next(k for k in after if k.startswith(name))
        return after[key] - before.get(key, 0.0)

    assert delta("vllm:prompt_tokens_total") == out.usage.prompt_tokens
    assert delta("vllm:generation_tokens_total") == 5
    assert delta('vllm:request_success_total{finished_reason="length"') == 1
    for h in (
        "vllm:time_to_first_token_seconds_count",
        "vllm:time_per_output_token_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
        "pagedllm:request_handoff_time_seconds_count",
        "vllm:request_queue_time_seconds_count",
        "vllm:request_prefill_time_seconds_count",
    ):
        assert delta(h) == 1
    # where the first token waited, on one clock across the two processes: the hand-off to
    # the engine core, the scheduler's queue and the prefill add up to the time to it
    parts = sum(delta(f"{h}_sum") for h in ("pagedllm:request_handoff_time_seconds",
                "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds"))
    assert parts == pytest.approx(delta("vllm:time_to_first_token_seconds_sum"), abs=1e-6)
    assert delta("vllm:request_prefill_time_seconds_sum") > 0
    assert server.metric("vllm:num_requests_running") == 0
    assert server.metric("pagedllm:kv_cache_total_blocks") > 0
