"""LoRA over HTTP (``build_app`` in-process, ASGI transport): a request's ``model`` picks an
adapter or the base model, a batch of both gives each one's reference tokens, ``/v1/models``
lists the adapters, and the run-time load / unload routes (on only where the environment
allows) add and remove them with vLLM's messages and errors."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from pagedllm.config import EngineArgs
from tests.lora.adapters import MAX_NEW
from tests.lora.adapters import prompts as _prompts

pytest.importorskip("fastapi")


def _completion(model: str, prompt: list[int]) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip


def test_adapters_by_model_name(lora_setup, references, monkeypatch) -> None:  # noqa: ANN001
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.entrypoints.openai.server import build_app

    base, adapters, _ = lora_setup
    monkeypatch.setenv("PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    args = EngineArgs(model=base, dtype="float32", max_model_len=256, block_size=8,
                      enable_lora=True, max_loras=2, max_cpu_loras=2,
                      lora_modules=[f"a1={adapters['a1']}"])  # fmt: skip
    llm = AsyncLLM.from_engine_args(args)
    try:
        app = build_app(llm)
        served = app.state.model_name
        prompts = _prompts()

        async def run() -> None:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                         timeout=120) as c:  # fmt: skip
                ids = [m["id"] for m in (await c.get("/v1/models")).json()["data"]]
                assert ids == [served, "a1"]

                async def tokens(model: str, prompt: list[int]) -> list[int]:
                    r = await c.post("/v1/completions", json=_completion(model, prompt))
                    assert r.status_code == 200, r.text
                    return r.json()["choices"][0]["token_ids"]

                r = await c.post("/v1/load_lora_adapter",
                                 json={"lora_name": "a2", "lora_path": adapters["a2"]})  # fmt: skip
                assert r.status_code == 200 and "a2" in r.text
                jobs = [tokens(m, p) for m in ("a1", "a2", served) for p in prompts]
                got = await asyncio.gather(*jobs)  # one batch: both adapters and the base
                assert got == references["a1"] + references["a2"] + references["base"]
                chat = await c.post("/v1/chat/completions", json={
                    "model": "a2", "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 2})  # fmt: skip
                assert chat.status_code == 200, chat.text
                assert chat.json()["model"] == "a2"  # the adapter's name, as vLLM replies

                bad = [
                    ({"lora_name": "a2", "lora_path": adapters["a2"]}, 400, "lora_name"),
                    ({"lora_name": "x", "lora_path": adapters["a1"] + "-missing"}, 400,
                     "lora_path"),
                    ({"lora_path": adapters["a1"]}, 400, "lora_name"),
                ]  # fmt: skip
                for body, status, param in bad:
                    r = await c.post("/v1/load_lora_adapter", json=body)
                    assert r.status_code == status and r.json()["error"]["param"] == param, r.text
                r = await c.post("/v1/unload_lora_adapter", json={"lora_name": "a2"})
                assert r.status_code == 200
                r = await c.post("/v1/completions", json=_completion("a2", prompts[0]))
                assert r.status_code == 404 and r.json()["error"]["param"] == "model"
                r = await c.post("/v1/unload_lora_adapter", json={"lora_name": "a2"})
                assert r.status_code == 404
                ids = [m["id"] for m in (await c.get("/v1/models")).json()["data"]]
                assert ids == [served, "a1"]

        asyncio.run(run())
    finally:
        llm.shutdown()


def test_runtime_routes_need_the_environment(lora_setup, monkeypatch) -> None:  # noqa: ANN001
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.entrypoints.openai.server import build_app

    base, adapters, _ = lora_setup
    monkeypatch.delenv("PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    args = EngineArgs(model=base, dtype="float32", max_model_len=64, block_size=8,
                      num_gpu_blocks_override=16)  # fmt: skip
    llm = AsyncLLM.from_engine_args(args)
    try:
        app = build_app(llm)

        async def run() -> None:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                r = await c.post("/v1/load_lora_adapter",
                                 json={"lora_name": "a1", "lora_path": adapters["a1"]})  # fmt: skip
                assert r.status_code == 404
                r = await c.post("/v1/completions", json=_completion("a1", [5, 6]))
                assert r.status_code == 404 and "a1" in r.json()["error"]["message"]

        asyncio.run(run())
    finally:
        llm.shutdown()

