"""Many concurrent streaming clients; clients that go away mid-stream free their KV blocks."""

from __future__ import annotations

import asyncio

import httpx

from tests.server.conftest import LiveServer

NUM_CLIENTS = 64
NUM_ABORTS = 20
PROMPTS = [f"Write the number {i} in words:" for i in range(8)]


def test_64_concurrent_streams(server: LiveServer, client) -> None:  # noqa: ANN001
    """Every stream completes with exactly its tokens, and its text equals the text the same
    prompt gets alone (greedy)."""
    kw = dict(model=server.model, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    alone = {p: client.completions.create(prompt=p, **kw).choices[0].text for p in PROMPTS}

    async def one(aclient, i: int) -> tuple[str, str, str | None, int]:  # noqa: ANN001
        prompt = PROMPTS[i % len(PROMPTS)]
        stream = await aclient.completions.create(
            prompt=prompt, stream=True, stream_options={"include_usage": True}, **kw
        )
        parts, finish, usage = [], None, 0
        async for chunk in stream:
            if chunk.choices:
                parts.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        return prompt, "".join(parts), finish, usage

    async def run() -> list[tuple[str, str, str | None, int]]:
        limits = httpx.Limits(max_connections=NUM_CLIENTS + 8)
        async with server.async_client(
            max_retries=0, timeout=300, http_client=httpx.AsyncClient(limits=limits)
        ) as aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(NUM_CLIENTS)))

    results = asyncio.run(run())
    assert len(results) == NUM_CLIENTS
    for prompt, text, finish, usage in results:
        assert finish == "length" and usage == 16
        assert text == alone[prompt]
    server.wait_idle()


def test_aborted_streams_free_kv_cache(server: LiveServer) -> None:
    """20 streams read half of their tokens, then disconnect; plus 2 non-streaming requests
    whose clients time out. Every request is aborted and the KV cache is empty again."""
    aborts_before = server.metric("vllm:request_success_total", finished_reason="abort")
    body = {"model": server.model, "prompt": "Tell me a long story.", "max_tokens": 64,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip

    async def one(ac: httpx.AsyncClient) -> int:
        seen = 0
        async with ac.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    seen += 1
                    if seen == 32:  # halfway: hang up
                        break
        return seen

    async def slow_non_streaming(ac: httpx.AsyncClient) -> None:
        nb = {**body, "stream": False, "max_tokens": 400}
        try:
            await ac.post("/v1/completions", json=nb, timeout=1.5)
        except httpx.TimeoutException:
            return
        raise AssertionError("expected the client to time out first")

    async def run() -> list[int]:
        limits = httpx.Limits(max_connections=NUM_ABORTS + 8)
        async with httpx.AsyncClient(
            base_url=server.url, headers=server.headers, timeout=120, limits=limits
        ) as ac:
            results = await asyncio.gather(
                *(one(ac) for _ in range(NUM_ABORTS)), *(slow_non_streaming(ac) for _ in range(2))
            )
        return [r for r in results if r is not None]

    seen = asyncio.run(run())
    assert seen == [32] * NUM_ABORTS
    server.wait_idle(timeout=60)
    aborted = server.metric("vllm:request_success_total", finished_reason="abort") - aborts_before
    assert aborted == NUM_ABORTS + 2
    assert httpx.get(f"{server.url}/health").status_code == 200
