"""Prefix caching over HTTP: the ``vllm:prefix_cache_*`` counters, ``cached_tokens`` in the
usage, and ``cache_salt`` keeping tenants' cache entries apart."""

from __future__ import annotations

import uuid

from tests.server.conftest import LiveServer

DOC = " ".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog." for i in range(12))


def _prefix() -> str:
    return f"[{uuid.uuid4().hex}] {DOC}"  # unique to this call: nothing cached before


def _cached(out) -> int:  # noqa: ANN001
    return out.usage.prompt_tokens_details.cached_tokens


def test_prefix_cache_metrics_rise(server: LiveServer, client) -> None:  # noqa: ANN001
    prefix = _prefix()
    q0 = server.metric("vllm:prefix_cache_queries_total")
    h0 = server.metric("vllm:prefix_cache_hits_total")
    kw = dict(model=server.model, max_tokens=2, temperature=0)
    first = client.completions.create(prompt=prefix + " Question one?", **kw)
    q1 = server.metric("vllm:prefix_cache_queries_total")
    h1 = server.metric("vllm:prefix_cache_hits_total")
    assert q1 - q0 == first.usage.prompt_tokens and h1 == h0 and _cached(first) == 0
    second = client.completions.create(prompt=prefix + " Question two?", **kw)
    q2 = server.metric("vllm:prefix_cache_queries_total")
    h2 = server.metric("vllm:prefix_cache_hits_total")
    assert q2 - q1 == second.usage.prompt_tokens
    assert h2 - h1 == _cached(second) >= 128  # the shared document's full blocks
    assert _cached(second) < second.usage.prompt_tokens


def test_cache_salt_isolates(server: LiveServer, client) -> None:  # noqa: ANN001
    prompt = _prefix()
    kw = dict(model=server.model, prompt=prompt, max_tokens=2, temperature=0)
    a1 = client.completions.create(**kw, extra_body={"cache_salt": "tenant-a"})
    b1 = client.completions.create(**kw, extra_body={"cache_salt": "tenant-b"})
    unsalted = client.completions.create(**kw)
    a2 = client.completions.create(**kw, extra_body={"cache_salt": "tenant-a"})
    assert _cached(a1) == _cached(b1) == _cached(unsalted) == 0  # no sharing across salts
    assert _cached(a2) >= 128 and a2.choices[0].text == a1.choices[0].text
    chat = [{"role": "user", "content": prompt}]
    c1 = client.chat.completions.create(
        model=server.model, messages=chat, max_tokens=2, extra_body={"cache_salt": "t-c"}
    )
    c2 = client.chat.completions.create(
        model=server.model, messages=chat, max_tokens=2, extra_body={"cache_salt": "t-c"}
    )
    assert _cached(c1) == 0 and _cached(c2) >= 128
