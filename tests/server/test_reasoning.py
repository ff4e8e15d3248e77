"""Reasoning output (``--reasoning-parser qwen3``) in-process, on a tiny random Qwen3 whose
tokenizer has Qwen3's special tokens and a chat template in Qwen3's format (ChatML; the
thinking opened by ``<think>\\n`` in the generation prompt, as Qwen3's thinking templates do,
or closed at once by ``<think>\\n\\n</think>\\n\\n`` under ``enable_thinking=False``). The
weights are random, so the output is steered: ``allowed_token_ids`` lets the model pick among a
few letters and ``</think>``, and a regex asks for the answer. The regex forbids the letters
the thinking uses, so a split answer that matches it shows the grammar started after the
thinking, not before.

Also the server-side refusals of tool calling: ``auto`` without ``--enable-auto-tool-choice``,
and a reasoning parser on a tokenizer without ``</think>``."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from argparse import Namespace
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.server import build_app

pytest.importorskip("xgrammar")

# Qwen3's format, written for this test (the real file cannot be downloaded here): ChatML turns,
# tools in the system turn, the generation prompt opening the thinking.
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>"
    "{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}\n</tools><|im_end|>\n{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{%- else %}<think>\n{%- endif %}{%- endif %}"
)
ANSWER = r"(yes|no)( ok)*"
THINK_LETTERS = "abc"  # the regex above has none of them


@pytest.fixture(scope="module")
def qwen3_dir(tiny_models, tmp_path_factory) -> str:  # noqa: ANN001
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("qwen3_think") / "model"
    shutil.copytree(tiny_models("qwen3"), out)
    tok = AutoTokenizer.from_pretrained(out)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.add_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>"])
    tok.chat_template = TEMPLATE
    tok.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def llm(qwen3_dir: str) -> Iterator[AsyncLLM]:
    from pagedllm.config import EngineArgs

    args = EngineArgs(model=qwen3_dir, dtype="float32", max_model_len=256,
                      num_gpu_blocks_override=64, device="cpu", seed=0)  # fmt: skip
    engine = AsyncLLM.from_engine_args(args)
    yield engine
    engine.shutdown()


def _post(app: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as c:
            return await c.post(path, json=body)

    return asyncio.run(go())


def _body(llm: AsyncLLM, **kw: Any) -> dict[str, Any]:
    tok = llm.tokenizer
    chars = THINK_LETTERS + "yesnok "
    allowed = [tok.encode(ch, add_special_tokens=False)[0] for ch in chars]
    allowed.append(tok.convert_tokens_to_ids("</think>"))
    return {"messages": [{"role": "user", "content": "Is it?"}], "max_tokens": 48,
            "temperature": 1.0, "seed": 6, "allowed_token_ids": allowed,
            "guided_regex": ANSWER, **kw}  # fmt: skip


def _stream_parts(app: Any, body: dict[str, Any]) -> tuple[str | None, str]:
    r = _post(app, "/v1/chat/completions", {**body, "stream": True})
    assert r.status_code == 200, r.text
    reasoning, content = None, ""
    for line in r.text.splitlines():
        if not line.startswith("data: {"):
            continue
        for ch in json.loads(line[6:])["choices"]:
            d = ch["delta"]
            if "reasoning_content" in d:
                reasoning = (reasoning or "") + d["reasoning_content"]
            content += d.get("content") or ""
    return reasoning, content


def test_thinking_is_split_and_the_grammar_starts_after_it(llm: AsyncLLM) -> None:
    app = build_app(llm, Namespace(reasoning_parser="qwen3"))
    r = _post(app, "/v1/chat/completions", _body(llm))
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    reasoning, content = msg["reasoning_content"], msg["content"]
    assert reasoning and set(reasoning) <= set(THINK_LETTERS + "yesnok "), reasoning
    assert set(reasoning) & set(THINK_LETTERS)  # letters the answer's grammar forbids
    assert re.fullmatch(ANSWER, content) or re.fullmatch(ANSWER + r" ?o?", content), content
    assert "think>" not in reasoning + content
    assert _stream_parts(app, _body(llm)) == (reasoning, content)  # same seed, same split
    hidden = _post(app, "/v1/chat/completions", _body(llm, include_reasoning=False)).json()
    assert "reasoning_content" not in hidden["choices"][0]["message"]
    assert hidden["choices"][0]["message"]["content"] == content


def test_no_thinking_when_the_template_closes_it(llm: AsyncLLM) -> None:
    app = build_app(llm, Namespace(reasoning_parser="qwen3"))
    body = _body(llm, chat_template_kwargs={"enable_thinking": False})
    msg = _post(app, "/v1/chat/completions", body).json()["choices"][0]["message"]
    assert msg["reasoning_content"] is None
    # the grammar applied from the first token: no thinking letters at all
    assert re.fullmatch(ANSWER + r"( ?o?)", msg["content"]) or re.fullmatch(ANSWER, msg["content"])


def test_an_output_that_does_not_think_is_constrained_from_its_first_token(llm: AsyncLLM
                                                                            ) -> None:  # fmt: skip
    """Qwen3's original templates leave the opening to the model: here it may not write
    ``<think>`` (not allowed), so there is no thinking and the grammar must apply from the
    second token on, the first being judged by the matcher (the letters abc never appear)."""
    app = build_app(llm, Namespace(reasoning_parser="qwen3"))
    opening_left_to_the_model = TEMPLATE.replace("{%- else %}<think>\n", "{%- else %}")
    think = {llm.tokenizer.convert_tokens_to_ids(t) for t in ("<think>", "</think>")}
    for seed in range(4):
        body = _body(llm, chat_template=opening_left_to_the_model, seed=seed)
        body["allowed_token_ids"] = [t for t in body["allowed_token_ids"] if t not in think]
        r = _post(app, "/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        msg = r.json()["choices"][0]["message"]
        assert msg["reasoning_content"] is None
        assert re.fullmatch(ANSWER + r"( ?o?)", msg["content"]) or re.fullmatch(
            ANSWER, msg["content"]), (seed, msg["content"])  # fmt: skip


def test_server_refusals(llm: AsyncLLM, tiny_models) -> None:  # noqa: ANN001
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    app = build_app(llm)  # no --enable-auto-tool-choice
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools, "max_tokens": 2}
    r = _post(app, "/v1/chat/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert "--enable-auto-tool-choice" in r.json()["error"]["message"]
    ok = _post(app, "/v1/chat/completions", {**body, "tool_choice": "none"})
    assert ok.status_code == 200
    # vLLM's --exclude-tools-when-tool-choice-none: the template sees no tools then
    names = "{% for t in tools or [] %}{{ t.function.name }}{% endfor %}."
    for exclude, want in ((False, "f."), (True, ".")):
        app2 = build_app(llm, Namespace(exclude_tools_when_tool_choice_none=exclude))
        r = _post(app2, "/v1/chat/completions", {**body, "tool_choice": "none",
                                                 "chat_template": names})  # fmt: skip
        assert r.json()["usage"]["prompt_tokens"] == len(llm.tokenizer.encode(
            want, add_special_tokens=False)), exclude  # fmt: skip
    with pytest.raises(ValueError, match="--tool-call-parser"):
        build_app(llm, Namespace(enable_auto_tool_choice=True))
    with pytest.raises(ValueError, match="tool-call-parser"):
        build_app(llm, Namespace(tool_call_parser="nope"))
    from pagedllm.config import EngineArgs

    plain = AsyncLLM.from_engine_args(EngineArgs(model=tiny_models("llama"), dtype="float32",
                                                 max_model_len=64, num_gpu_blocks_override=8,
                                                 device="cpu"))  # fmt: skip
    try:
        with pytest.raises(ValueError, match="no single token for '<think>'"):
            build_app(plain, Namespace(reasoning_parser="qwen3"))
    finally:
        plain.shutdown()
