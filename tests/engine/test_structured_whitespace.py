"""The engine-wide JSON whitespace setting (``--structured-outputs-max-whitespace`` and
``--structured-outputs-disable-any-whitespace``): the default of every request that does not
set ``disable_any_whitespace`` itself, in the engine's process and in an engine core process of
its own."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineArgs, StructuredOutputsConfig
from pagedllm.structured_output.params import MAX_JSON_WHITESPACE
from pagedllm.structured_output.params import StructuredOutputsParams as S

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a"],
    "additionalProperties": False,
}
N = 12


def _params(disable_any_whitespace: bool | None = None) -> list[SamplingParams]:
    so = S(json=SCHEMA, disable_any_whitespace=disable_any_whitespace)
    return [
        SamplingParams(temperature=1.0, seed=i, max_tokens=64, structured_outputs=so)
        for i in range(N)
    ]


PROMPTS = [{"prompt_token_ids": list(range(10 + i, 40 + i))} for i in range(N)]


def _longest_runs(texts: list[str]) -> list[int]:
    """Each output parses and validates; the longest whitespace run of each."""
    runs = []
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
        runs.append(max((len(r) for r in re.findall(r"\s+", text)), default=0))
    return runs


def _texts(llm: LLM, params: list[SamplingParams]) -> list[str]:
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "stop" for o in outs), [o.outputs[0] for o in outs]
    return [o.outputs[0].text for o in outs]


def test_engine_default_compact_and_request_override(tiny_models) -> None:  # noqa: ANN001
    """max_whitespace 0: compact JSON for requests that say nothing; a request's own
    ``disable_any_whitespace=False`` wins (bounded whitespace, which this random model
    does produce at temperature 1)."""
    llm = LLM(tiny_models("llama"), dtype="float32", max_model_len=128,
              structured_outputs_max_whitespace=0)  # fmt: skip
    assert llm.llm_engine.config.structured_outputs_config.max_whitespace == 0
    assert max(_longest_runs(_texts(llm, _params()))) == 0
    runs = _longest_runs(_texts(llm, _params(disable_any_whitespace=False)))
    assert 0 < max(runs) <= MAX_JSON_WHITESPACE, runs


def test_engine_bound_and_request_compact(tiny_models) -> None:  # noqa: ANN001
    """max_whitespace 2 bounds the runs at 2 characters (the default, 8, lets this model write
    longer ones); a request's ``disable_any_whitespace=True`` still gets compact JSON."""
    model = tiny_models("llama")
    default = LLM(model, dtype="float32", max_model_len=128)
    assert max(_longest_runs(_texts(default, _params()))) > 2
    del default
    llm = LLM(model, dtype="float32", max_model_len=128, structured_outputs_max_whitespace=2)
    runs = _longest_runs(_texts(llm, _params()))
    assert 0 < max(runs) <= 2, runs
    assert max(_longest_runs(_texts(llm, _params(disable_any_whitespace=True)))) == 0


def test_disable_any_whitespace_flag_means_zero() -> None:
    args = EngineArgs(structured_outputs_disable_any_whitespace=True)
    assert args._structured_outputs_config().max_whitespace == 0
    assert EngineArgs()._structured_outputs_config().max_whitespace == MAX_JSON_WHITESPACE
    bad = ["-1", 65, True, 1.5]
    for value in bad:
        with pytest.raises(ValueError, match="structured_outputs_max_whitespace"):
            StructuredOutputsConfig(max_whitespace=value)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="structured_outputs_disable_any_whitespace"):
        EngineArgs(structured_outputs_disable_any_whitespace="yes")._structured_outputs_config()


def test_request_setting_resolution() -> None:
    """None follows the engine; True is compact; False is bounded (by the engine's bound, or
    the default one where the engine's is 0). The compile cache key carries the bound."""
    for engine_ws, expect in ((8, (8, 0, 8)), (0, (0, 0, 8)), (3, (3, 0, 3))):
        got = tuple(S(json=SCHEMA, disable_any_whitespace=d).json_whitespace(engine_ws)
                    for d in (None, True, False))  # fmt: skip
        assert got == expect, engine_ws
    assert S(json=SCHEMA).key(0)[0] == "json:ws0"
    assert S(json_object=True).key(5)[0] == "json_object:ws5"
    assert S(regex="a+").key(0) == ("regex", "a+")
    with pytest.raises(ValueError, match="disable_any_whitespace"):
        S(json=SCHEMA, disable_any_whitespace="no")  # type: ignore[arg-type]


def _manager_whitespace(core) -> int:  # noqa: ANN001 - runs in the core process
    return core.structured_output_manager().max_whitespace


def test_setting_reaches_the_core_process(tiny_models) -> None:  # noqa: ANN001
    """The config travels pickled to an engine core process of its own (MPAsyncLLM): its
    grammar compiler uses the engine's bound and the outputs are compact."""
    from pagedllm.engine.mp_async_llm import MPAsyncLLM

    args = EngineArgs(
        model=tiny_models("llama"),
        dtype="float32",
        device="cpu",
        max_model_len=128,
        structured_outputs_disable_any_whitespace=True,
    )
    llm = MPAsyncLLM.from_engine_args(args)
    try:

        async def run() -> list[str]:
            params = _params()
            await llm.start()
            await llm.check_structured_outputs(params[0])
            assert await llm.call_in_core(_manager_whitespace) == 0

            async def one(i: int) -> str:
                text = ""
                async for out in llm.generate(PROMPTS[i], params[i]):
                    text += out.outputs[0].text
                    if out.finished:
                        assert out.outputs[0].finish_reason == "stop", text
                return text

            return list(await asyncio.gather(*(one(i) for i in range(N))))

        texts = asyncio.run(asyncio.wait_for(run(), 120))
    finally:
        llm.shutdown()
    assert max(_longest_runs(texts)) == 0
