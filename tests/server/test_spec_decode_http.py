"""Speculative decoding over HTTP: ``pagedllm serve --speculative-config`` on the default model
gives the same greedy completions and streams as the default server, exports vLLM's
``vllm:spec_decode_*`` metrics, and a bad config stops the server at start with the field
named."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import ROOT, LiveServer, live_server

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
# the reply copies from the prompt, so prompt lookup finds drafts that are accepted
WORDS = "one two three four five six seven eight nine ten"
MESSAGES = [{"role": "user", "content": f"Repeat after me: {WORDS}."}]


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("spec_server") / "server.log"
    with live_server(log, ("--speculative-config", json.dumps(SPEC))) as srv:
        yield srv


def _chat(srv: LiveServer, **extra: object) -> httpx.Response:
    body = {"model": srv.model, "messages": MESSAGES, "max_tokens": 48, "temperature": 0, **extra}
    return httpx.post(srv.url + "/v1/chat/completions", json=body, headers=srv.headers, timeout=120)


def test_same_replies_and_metrics(server: LiveServer, spec_server: LiveServer) -> None:
    want = _chat(server)
    got = _chat(spec_server)
    assert want.status_code == got.status_code == 200, got.text
    text = want.json()["choices"][0]["message"]["content"]
    assert got.json()["choices"][0]["message"]["content"] == text
    # (cached prompt tokens differ: the shared default server has served earlier tests)
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert got.json()["usage"][key] == want.json()["usage"][key], key
    # streamed: the deltas join to the same text (a chunk may carry several tokens)
    body = {"model": spec_server.model, "messages": MESSAGES, "max_tokens": 48,
            "temperature": 0, "stream": True}  # fmt: skip
    url = spec_server.url + "/v1/chat/completions"
    with httpx.stream("POST", url, json=body, headers=spec_server.headers, timeout=120) as r:
        assert r.status_code == 200
        events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == text
    spec_server.wait_idle()
    drafts = spec_server.metric("vllm:spec_decode_num_drafts_total")
    draft_tokens = spec_server.metric("vllm:spec_decode_num_draft_tokens_total")
    accepted = spec_server.metric("vllm:spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and draft_tokens >= drafts and 0 < accepted <= draft_tokens
    first = spec_server.metric("vllm:spec_decode_num_accepted_tokens_per_pos_total", position="0")
    assert 0 < first <= drafts


def _same_reply_with_drafts(server: LiveServer, log: Path, args: tuple[str, ...]) -> None:
    """A server started with ``args`` gives the default ``server``'s greedy reply, and its
    drafts are accepted."""
    with live_server(log, args) as srv:
        got = _chat(srv)
        srv.wait_idle()
        accepted = srv.metric("vllm:spec_decode_num_accepted_tokens_total")
    want = _chat(server)
    assert got.status_code == want.status_code == 200, got.text
    text = want.json()["choices"][0]["message"]["content"]
    assert got.json()["choices"][0]["message"]["content"] == text
    assert accepted > 0


def test_draft_model_server_same_replies(server: LiveServer, tmp_path: Path) -> None:
    """``--speculative-config '{"model": ...}'``: the default model drafting for itself (the
    packaged GGUF) gives the default server's greedy reply, and its drafts are accepted."""
    from pagedllm.model.packaged import smollm2_gguf_path

    spec = json.dumps({"model": str(smollm2_gguf_path()), "num_speculative_tokens": 3})
    _same_reply_with_drafts(server, tmp_path / "draft.log", ("--speculative-config", spec))


def test_ngram_gpu_server_same_replies(server: LiveServer, tmp_path: Path) -> None:
    """``--speculative-config '{"method": "ngram_gpu", ...}' --async-scheduling``: the lookup
    in the runner, the engine's steps asynchronous while drafting; the default server's greedy
    reply, drafts accepted."""
    spec = json.dumps({**SPEC, "method": "ngram_gpu"})
    args = ("--speculative-config", spec, "--async-scheduling")
    _same_reply_with_drafts(server, tmp_path / "ngram_gpu.log", args)


def test_bad_config_fails_at_start() -> None:
    bad = json.dumps({"method": "ngram", "num_speculative_tokens": 0})
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--device", "cpu",
           "--speculative-config", bad]  # fmt: skip
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    assert "num_speculative_tokens" in r.stderr + r.stdout
