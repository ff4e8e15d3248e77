"""Structured outputs on the real default model (SmolLM2-135M): JSON schemas, regexes,
choices and grammars under sampling at temperature 1.0 always parse and validate; bad
grammars raise clear errors and never disturb other requests."""

from __future__ import annotations

import json
import re

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.structured_output.params import StructuredOutputsParams as S

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

NAME = {"type": "string", "minLength": 1, "maxLength": 12}
SCHEMAS = [
    {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "city": NAME,
            "population": {"type": "integer", "minimum": 1, "maximum": 10**8},
            "coords": {
                "type": "object",
                "properties": {
                    "lat": {"type": "number", "minimum": -90, "maximum": 90},
                    "lon": {"type": "number", "minimum": -180, "maximum": 180},
                },
                "required": ["lat", "lon"],
                "additionalProperties": False,
            },
        },
        "required": ["city", "coords"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3},
            "status": {"enum": ["open", "closed", "pending"]},
        },
        "required": ["tags", "status"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "items": {
                "type": "array",
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "integer", "minimum": 0, "maximum": 999},
                        "label": NAME,
                    },
                    "required": ["id"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["ok", "items"],
        "additionalProperties": False,
    },
]
REGEXES = {
    "date": r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",
    "email": r"[a-z]{1,8}@[a-z]{1,8}\.(com|org|net)",
    "phone": r"\+1-\d{3}-\d{3}-\d{4}",
}
CHOICES = ["positive", "negative", "neutral"]
# a grammar a tiny random model finishes within ~30 tokens (also used by the async tests)
SMALL_OBJECT = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm() -> LLM:
    from pagedllm.model.packaged import smollm2_gguf_path

    return LLM(smollm2_gguf_path(), dtype="float32", max_model_len=1024, seed=0)


def test_100_constrained_requests_all_valid(llm):
    prompts, params, checks = [], [], []
    for i in range(100):
        kind = i % 4
        if kind == 0 or kind == 1:
            schema = SCHEMAS[i % len(SCHEMAS)]
            prompts.append("Give me an example record as JSON:")
            params.append(S(json=schema))
            checks.append(lambda t, s=schema: jsonschema.validate(json.loads(t), s))
        elif kind == 2:
            name, rx = list(REGEXES.items())[i % 3]
            prompts.append(f"Write a {name}:")
            params.append(S(regex=rx))
            checks.append(lambda t, rx=rx: re.fullmatch(rx, t) or pytest.fail(t))
        else:
            prompts.append("Sentiment of 'I love it':")
            params.append(S(choice=CHOICES))
            checks.append(lambda t: t in CHOICES or pytest.fail(t))
    outs = llm.generate(
        prompts,
        [
            SamplingParams(temperature=1.0, seed=i, max_tokens=160, structured_outputs=p)
            for i, p in enumerate(params)
        ],
        use_tqdm=False,
    )
    for out, check in zip(outs, checks):
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text
        check(c.text)
    llm.llm_engine.engine_core.check_integrity()


def test_min_tokens_yields_to_a_grammar_that_must_end(llm):
    """min_tokens longer than the grammar allows: the output is a valid choice that stops
    (not an error: the grammar's end wins once EOS is its only token)."""
    for structured in (S(choice=["yes", "no"]), S(regex="[a-z]{2}")):
        params = SamplingParams(temperature=1.0, seed=0, max_tokens=16, min_tokens=5,
                                structured_outputs=structured)  # fmt: skip
        out = llm.generate(["Answer:"], params, use_tqdm=False)[0]
        c = out.outputs[0]
        assert out.error is None and c.finish_reason == "stop", (out.error, c.text)
        assert c.text in ("yes", "no") if structured.choice else re.fullmatch("[a-z]{2}", c.text)
    llm.llm_engine.engine_core.check_integrity()


def test_grammar_and_json_object_and_n(llm):
    ebnf = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    out = llm.generate(
        ["An arithmetic sum:"],
        SamplingParams(
            temperature=1.0, seed=3, max_tokens=40, n=3, structured_outputs=S(grammar=ebnf)
        ),
        use_tqdm=False,
    )[0]
    assert len(out.outputs) == 3
    for c in out.outputs:
        assert re.fullmatch(r"\((\d{1,2})(\+\d{1,2})*\)", c.text), c.text
    obj = llm.generate(
        ["A JSON object:"],
        SamplingParams(
            temperature=0.7, seed=1, max_tokens=200, structured_outputs={"json_object": True}
        ),
        use_tqdm=False,
    )[0].outputs[0]
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)
    else:  # a long object cut by max_tokens is still a JSON prefix starting with "{"
        assert obj.text.lstrip().startswith("{")


@pytest.mark.parametrize("process", [False, True], ids=["local", "process"])
def test_structured_with_preemption_and_greedy_equality(process, tiny_models):
    """Preempted (recomputed) structured requests, two of them with n = 2, keep their
    grammar state: the texts equal a run without preemption, with the matchers in the
    engine's process or in the grammar worker."""
    schema = SMALL_OBJECT
    path = tiny_models("llama")
    p = [
        SamplingParams(
            temperature=1.0,
            seed=i,
            max_tokens=30,
            n=2 if i < 2 else 1,
            structured_outputs=S(json=schema),
        )
        for i in range(6)
    ]
    prompts = [{"prompt_token_ids": list(range(10 + i, 50 + i))} for i in range(6)]
    roomy = LLM(path, dtype="float32", max_model_len=256).generate(prompts, p, use_tqdm=False)
    tight_llm = LLM(
        path,
        dtype="float32",
        max_model_len=256,
        block_size=8,
        num_gpu_blocks_override=10,
        grammar_process=process,
    )
    tight = tight_llm.generate(prompts, p, use_tqdm=False)
    assert tight_llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    texts = [[c.text for c in o.outputs] for o in roomy]
    assert [[c.text for c in o.outputs] for o in tight] == texts
    assert [len(t) for t in texts] == [2, 2, 1, 1, 1, 1]
    for o in roomy:
        for c in o.outputs:
            if c.finish_reason == "stop":
                jsonschema.validate(json.loads(c.text), schema)


@pytest.mark.parametrize(
    "bad, match",
    [
        (S(json='{"type": "object", "properties": 5}'), "json"),
        (S(json="{not json"), "json"),
        (S(regex="([a-z"), "regex"),
        (S(grammar='root ::= "a" |'), "grammar"),
        (S(json={"type": "object", "description": "x" * (3 << 20)}), "bytes"),
    ],
)
def test_bad_grammars_raise(llm, bad, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=bad), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_params_validation():
    with pytest.raises(ValueError, match="choice"):
        S(choice=[])
    with pytest.raises(ValueError, match="exactly one"):
        S(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        S()
    with pytest.raises(ValueError, match="unknown"):
        SamplingParams(structured_outputs={"jsn": {}})


def test_bad_grammar_ends_only_its_request_in_the_engine():
    from pagedllm.model.packaged import smollm2_gguf_path

    engine = LLMEngine.from_engine_args(
        EngineArgs(model=smollm2_gguf_path(), dtype="float32", max_model_len=512)
    )
    good = SamplingParams(temperature=0, max_tokens=8, structured_outputs=S(choice=["a", "b"]))
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request("good", "Pick a or b:", good)
    engine.add_request(
        "bad", "x", SamplingParams(max_tokens=8, structured_outputs=S(regex="(unclosed"))
    )
    engine.add_request("plain", "Hello", plain)
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    assert done["bad"].error and "regex" in done["bad"].error
    assert done["bad"].outputs[0].finish_reason == "abort"
    assert done["good"].outputs[0].text in ("a", "b") and done["good"].error is None
    assert len(done["plain"].outputs[0].token_ids) == 8
    engine.engine_core.check_integrity()


def test_matcher_rollback(llm):
    core = llm.llm_engine.engine_core
    mgr = core.structured_output_manager()
    m = mgr.matcher(mgr.compile_now(S(choice=["yes", "no"])))
    tok = llm.get_tokenizer()
    ids = tok.encode("yes")
    for t in ids:
        assert m.accept_token(t)
    m.rollback(len(ids))  # as after rejected speculative tokens
    assert all(m.accept_token(t) for t in tok.encode("no"))


def test_tokenizer_info_cache_follows_the_vocabulary(tiny_models, tmp_path, monkeypatch):
    """xgrammar's token table is cached on disk: a model replaced at the same path by one with
    the same sizes but other token ids (here '{' and '}' swapped) must not reuse the old
    table, or its grammars admit the wrong tokens (found with a stale cache: 0 of 12 JSON
    outputs parsed)."""
    import shutil

    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # the cache under a fresh home
    path = tmp_path / "model"
    shutil.copytree(tiny_models("llama"), path)
    schema = SMALL_OBJECT

    def texts() -> list[str]:
        llm = LLM(str(path), dtype="float32", max_model_len=128)
        params = [
            SamplingParams(
                temperature=1.0, seed=i, max_tokens=48, structured_outputs=S(json=schema)
            )
            for i in range(4)
        ]
        prompts = [{"prompt_token_ids": list(range(10 + i, 30 + i))} for i in range(4)]
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].text for o in outs if o.outputs[0].finish_reason == "stop"]

    for text in texts():
        jsonschema.validate(json.loads(text), schema)
    tok_file = path / "tokenizer.json"
    tok = json.loads(tok_file.read_text())
    vocab = tok["model"]["vocab"]
    vocab["{"], vocab["}"] = vocab["}"], vocab["{"]
    tok_file.write_text(json.dumps(tok))
    again = texts()
    assert again
    for text in again:
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("compact", [False, True], ids=["bounded", "compact"])
def test_json_whitespace_is_bounded(compact, tiny_models):
    """A random-weight model under a small schema at temperature 1: every output parses
    within 64 tokens; whitespace comes in runs of at most MAX_JSON_WHITESPACE characters, or
    not at all with ``disable_any_whitespace``."""
    from pagedllm.structured_output.params import MAX_JSON_WHITESPACE

    llm = LLM(tiny_models("llama"), dtype="float32", max_model_len=128)
    so = S(json=SMALL_OBJECT, disable_any_whitespace=compact)
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=64, structured_outputs=so)
        for i in range(12)
    ]
    prompts = [{"prompt_token_ids": list(range(10 + i, 40 + i))} for i in range(12)]
    for out in llm.generate(prompts, params, use_tqdm=False):
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop", repr(text)
        jsonschema.validate(json.loads(text), SMALL_OBJECT)
        runs = [len(r) for r in re.findall(r"\s+", text)]
        assert max(runs, default=0) <= (0 if compact else MAX_JSON_WHITESPACE), repr(text)
