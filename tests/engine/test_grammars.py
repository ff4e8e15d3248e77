"""The grammar matchers beside the engine loop (structured_output/grammars.py): the worker
process gives exactly the bitmasks and rejections of the in-process matchers for the same
operations (add, accept, fork, rollback, drop), a rejected token ends only its request, and a
dead worker is a clear error."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from pagedllm import SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.structured_output.params import StructuredOutputsParams as S

xgr = pytest.importorskip("xgrammar")

from pagedllm.structured_output.compiler import StructuredOutputManager  # noqa: E402
from pagedllm.structured_output.grammars import GrammarProcess, make_grammars  # noqa: E402
from tests.engine.test_structured_outputs import SCHEMAS, SMALL_OBJECT  # noqa: E402

SPECS = [S(json=SMALL_OBJECT), S(json=SCHEMAS[1]), S(regex=r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)"),
         S(choice=["positive", "negative", "neutral"])]  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer():  # noqa: ANN201
    """SmolLM2's tokenizer: from the packaged model, or (GPU runs, without the package) the
    copy PAGEDLLM_TOKENIZER_DIR names."""
    tok_dir = os.environ.get("PAGEDLLM_TOKENIZER_DIR")
    if tok_dir:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(tok_dir)
    from pagedllm.model.gguf_loader import load_gguf_tokenizer
    from pagedllm.model.packaged import smollm2_gguf_path

    return load_gguf_tokenizer(smollm2_gguf_path())


@pytest.fixture(scope="module")
def manager(tokenizer) -> StructuredOutputManager:  # noqa: ANN001
    return StructuredOutputManager(tokenizer, len(tokenizer), serialize=True)


def _allowed(mask_row: torch.Tensor, vocab: int) -> np.ndarray:
    bits = np.unpackbits(mask_row.numpy().view(np.uint8), bitorder="little")[:vocab]
    return np.nonzero(bits)[0]


def test_worker_process_matches_in_process_matchers(manager):
    vocab = manager.vocab_size
    local = make_grammars(False, manager, max_rows=16, pin=False, fill_threads=1)
    proc = make_grammars(True, manager, max_rows=16, pin=False, fill_threads=2)
    assert isinstance(proc, GrammarProcess)
    rng = np.random.default_rng(0)
    entries = [manager.compile_now(s) for s in SPECS]
    live = [f"r{i}" for i in range(8)]
    for i, rid in enumerate(live):
        for g in (local, proc):
            g.add(rid, entries[i % len(entries)])
    stop_ids = manager.stop_token_ids
    num_terminated = num_rejected = 0
    for step in range(40):
        if step == 3:  # parallel sampling: r0's second sequence continues from its state
            for g in (local, proc):
                g.fork("r0", "r0.1")
            live.append("r0.1")
        if step == 6:  # speculative decoding: undo r1's last two tokens
            for g in (local, proc):
                g.rollback("r1", 2)
        if step == 8:
            for g in (local, proc):
                g.drop("r2")
            live.remove("r2")
        order = list(rng.permutation(live))  # fill order is the caller's, any order
        results = []
        for g in (local, proc):
            g.submit(order)
            results.append(g.collect())
        a, b = results
        assert a.fill_ids == b.fill_ids == order
        assert torch.equal(a.mask, b.mask), f"bitmasks differ at step {step}"
        assert a.rejected == b.rejected
        num_rejected += len(a.rejected)
        for i, rid in enumerate(order):
            allowed = _allowed(a.mask[i], vocab)
            if step == 10 and rid == "r5":  # a token the grammar forbids: rejected, reported
                tok = int(np.setdiff1d(np.arange(vocab), allowed)[0])
            else:
                tok = int(rng.choice(allowed))
            for g in (local, proc):
                g.accept(rid, tok)
            if tok in stop_ids:  # the grammar terminated: its next rows are all ones
                live.remove(rid)
                num_terminated += 1
                for g in (local, proc):
                    g.drop(rid)
    assert num_rejected == 1 and num_terminated > 0
    proc.close()
    assert proc._proc is None


def test_grammar_worker_death_is_a_clear_error(manager):
    proc = make_grammars(True, manager, max_rows=4, pin=False, fill_threads=1)
    proc.add("a", manager.compile_now(SPECS[0]))
    proc.submit(["a"])
    assert proc.collect().mask is not None
    proc._proc.kill()
    proc._proc.wait()
    with pytest.raises(RuntimeError, match="grammar worker process exited"):
        proc.submit(["a"])
        proc.collect()
    proc.close()


@pytest.mark.parametrize("process", [False, True], ids=["local", "process"])
@pytest.mark.parametrize("asynch", [False, True], ids=["sync", "async"])
def test_rejected_token_ends_only_its_request(process, asynch, tiny_models):
    """A token a grammar rejects (pushed here behind the engine's back: a correct bitmask
    never lets one through) ends that request with an error; the others finish as alone."""
    path = tiny_models("llama")
    args = dict(model=path, dtype="float32", max_model_len=256, async_scheduling=asynch,
                grammar_process=process)  # fmt: skip
    grammar = SamplingParams(temperature=0, max_tokens=30, structured_outputs=S(json=SMALL_OBJECT))
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = {"a": list(range(10, 30)), "b": list(range(40, 55)), "c": list(range(60, 70))}
    params = {"a": grammar, "b": grammar, "c": plain}

    def run(inject: bool) -> dict:
        engine = LLMEngine.from_engine_args(EngineArgs(**args))
        for rid, p in prompts.items():
            engine.add_request(rid, {"prompt_token_ids": p}, params[rid])
        done: dict = {}
        injected = False
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = o
            core = engine.engine_core
            request = core.scheduler.requests.get("a")
            if inject and not injected and request is not None and request.num_output_tokens:
                z = engine.tokenizer.convert_tokens_to_ids("Z")  # never valid in SMALL_OBJECT
                core.scheduler.grammar_book.grammars.accept(request.grammar_key, z)
                injected = True
        engine.engine_core.check_integrity()
        engine.engine_core.shutdown()
        return done

    alone = run(inject=False)
    done = run(inject=True)
    assert done["a"].outputs[0].finish_reason == "abort"
    assert "rejected by the grammar" in done["a"].error
    for rid in ("b", "c"):
        assert done[rid].error is None
        assert done[rid].outputs[0].token_ids == alone[rid].outputs[0].token_ids


@pytest.mark.parametrize("process", [False, True], ids=["local", "process"])
def test_request_id_used_again_right_after_it_finished(process, tiny_models):
    """Async steps: a structured request that finishes was also computed in the step after;
    a new request with its id, added at once, must not get that stale token in its grammar
    (matchers are keyed by grammar key, not request id). It finishes as it does alone."""
    args = EngineArgs(model=tiny_models("llama"), dtype="float32", max_model_len=256,
                      async_scheduling=True, grammar_process=process)  # fmt: skip
    short = SamplingParams(temperature=0, max_tokens=3, structured_outputs=S(json=SMALL_OBJECT))
    full = SamplingParams(temperature=0, max_tokens=25, structured_outputs=S(json=SMALL_OBJECT))
    prompt = {"prompt_token_ids": list(range(20, 40))}
    alone = LLMEngine.from_engine_args(args)
    alone.add_request("x", prompt, full)
    expected = None
    while alone.has_unfinished_requests():
        for o in alone.step():
            if o.finished:
                expected = o.outputs[0].token_ids
    engine = LLMEngine.from_engine_args(args)
    engine.add_request("x", prompt, short)
    engine.add_request("other", {"prompt_token_ids": list(range(50, 60))}, full)
    reused, got = False, None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == "x" and o.finished:
                if not reused:
                    engine.add_request("x", prompt, full)  # the same id, at once
                    reused = True
                else:
                    got = o
    assert reused and got is not None and got.error is None
    assert got.outputs[0].token_ids == expected
    engine.engine_core.check_integrity()
    for e in (alone, engine):
        e.engine_core.shutdown()


@pytest.mark.parametrize("process", [False, True], ids=["in-loop", "worker"])
def test_spec_fill_masks_each_position_and_leaves_the_state(manager, tokenizer, process):
    """A request verifying drafts gets one bitmask row per position: row j is the mask after
    drafts 0..j-1 (the same rows as accepting them one by one), rows after a draft the
    grammar refuses are all ones, and the matcher's state is unchanged afterwards."""
    from pagedllm.structured_output.matchers import SpecFill, fill_rows

    vocab = manager.vocab_size
    tok = tokenizer
    spec = S(choice=["antidisestablishmentarianism", "photosynthesis"])
    entry = manager.compile_now(spec)
    g = make_grammars(process, manager, max_rows=16, pin=False, fill_threads=1)
    ref = make_grammars(False, manager, max_rows=16, pin=False, fill_threads=1)
    word = tok.encode("antidisestablishmentarianism", add_special_tokens=False)
    assert len(word) >= 3
    for x in (g, ref):
        x.add("a", entry)
        x.add("b", entry)
    # reference rows: accept the drafts one at a time and fill after each
    want = []
    for j in range(len(word)):
        ref.submit(["a"])
        want.append(ref.collect().mask[0].clone())
        ref.accept("a", word[j])
    bad = word[:1] + tok.encode(" zebra", add_special_tokens=False)[:1]  # refused second draft
    fills = [SpecFill("a", tuple(word[:-1])), "b", SpecFill("b", tuple(bad))]
    assert fill_rows(fills) == len(word) + 1 + 3
    g.submit(fills)
    step = g.collect()
    assert step.mask is not None and step.mask.shape[0] == fill_rows(fills)
    rows = step.mask
    for j in range(len(word)):
        assert torch.equal(rows[j], want[j]), j
    b0 = len(word)
    assert torch.equal(rows[b0], want[0]) and torch.equal(rows[b0 + 1], want[0])
    assert torch.equal(rows[b0 + 2], want[1])  # after the first draft (accepted)
    assert bool((rows[b0 + 3] == -1).all())  # after the refused one: anything
    assert bad[1] not in set(_allowed(rows[b0 + 2], vocab).tolist())
    # the drafts were rolled back: both matchers still at the start
    g.submit(["a", "b"])
    again = g.collect().mask
    assert torch.equal(again[0], want[0]) and torch.equal(again[1], want[0])
    g.close()
    ref.close()
