"""LoRA through the server's front end: ``MPAsyncLLM`` with its engine core in a process of
its own - adapters added, listed and removed by messages to the core, and a per-request
adapter carried to it - and the in-process ``AsyncLLM``; the tokens equal ``LLM``'s."""

from __future__ import annotations

import asyncio

import pytest

from pagedllm.beam_search import BeamSearchParams
from pagedllm.config import EngineArgs
from pagedllm.lora import LoRARequest
from tests.lora.adapters import PARAMS
from tests.lora.adapters import engine as _engine
from tests.lora.adapters import prompts as _prompts

BEAM = BeamSearchParams(beam_width=2, max_tokens=5, ignore_eos=True)


async def _collect(llm, prompt, lora) -> list[int]:  # noqa: ANN001
    tokens: list[int] = []
    async for out in llm.generate({"prompt_token_ids": prompt}, PARAMS, lora_request=lora):
        tokens += out.outputs[0].token_ids
    return tokens


async def _exercise(llm, adapters, references, beams=None) -> None:  # noqa: ANN001
    a1, a2 = LoRARequest("a1", 1, adapters["a1"]), LoRARequest("a2", 2, adapters["a2"])
    assert await llm.list_loras() == []
    assert await llm.add_lora(a1) is True
    with pytest.raises(ValueError, match="not found"):
        await llm.add_lora(LoRARequest("gone", 3, adapters["a1"] + "-missing"))
    assert [r.lora_name for r in await llm.list_loras()] == ["a1"]
    prompts = _prompts()
    jobs = [_collect(llm, p, lr) for lr in (a1, a2, None) for p in prompts]  # a2: loaded
    got = await asyncio.gather(*jobs)  # by its first request
    want = references["a1"] + references["a2"] + references["base"]
    assert got == want
    assert await llm.remove_lora("a1") is True
    assert [r.lora_name for r in await llm.list_loras()] == ["a2"]
    if beams is not None:  # a beam search runs every beam with its adapter
        stream = await llm.add_beam_request({"prompt_token_ids": prompts[0]}, BEAM,
                                            lora_request=a2)  # fmt: skip
        outs = [o async for o in stream]
        assert [c.token_ids for c in outs[-1].outputs] == beams


@pytest.mark.parametrize("front", ["process", "thread"])
def test_async_front_ends_carry_adapters(front, lora_setup, references):
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.engine.mp_async_llm import MPAsyncLLM

    base, adapters, merged = lora_setup
    args = EngineArgs(model=base, dtype="float32", max_model_len=256, block_size=8,
                      enable_lora=True, max_loras=2, max_cpu_loras=2)  # fmt: skip
    cls = MPAsyncLLM if front == "process" else AsyncLLM
    # the merged a2 checkpoint's beams (the process front end sends beams in their own message)
    want = _engine(merged["a2"]).beam_search([{"prompt_token_ids": _prompts()[0]}], BEAM)
    beams = [s.tokens for s in want[0].sequences]
    llm = cls.from_engine_args(args)
    try:
        asyncio.run(asyncio.wait_for(_exercise(llm, adapters, references, beams), 120))
    finally:
        llm.shutdown()
