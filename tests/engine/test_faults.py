"""Fault injection in the engine (issue 18): a step that raises ends only the requests it may
have left wrong, their blocks are freed, and the engine serves the next requests with the same
greedy tokens as if nothing had happened; several failed steps in a row kill it; a detokenizer
that raises ends its own request only. (Over HTTP: tests/server/test_faults.py.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.engine.core import MAX_CONSECUTIVE_STEP_FAILURES, StepFailure
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.llm_engine import LLMEngine

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _prompt(seed: int, n: int = 40) -> dict[str, list[int]]:
    """40 tokens: two full blocks of 16 (prefix-cached) and a partial one."""
    return {"prompt_token_ids": np.random.default_rng(seed).integers(3, 250, size=n).tolist()}


PROMPTS = {"A": _prompt(1), "B": _prompt(2), "C": _prompt(3)}


def _engine(tiny_models: Callable[[str], str], **kw: Any) -> LLMEngine:
    # max_num_seqs 2: of A, B, C, the third waits for a free slot
    kw = {"max_model_len": 128, "num_gpu_blocks_override": 64, "max_num_seqs": 2, **kw}
    args = EngineArgs(model=tiny_models("llama"), dtype="float32", device="cpu", seed=0, **kw)
    return LLMEngine.from_engine_args(args)


def _drain(engine: LLMEngine) -> tuple[dict[str, Any], list[StepFailure]]:
    """Step until idle, recovering from failed steps as the front ends do: (final outputs by
    request id, the failures)."""
    finals: dict[str, Any] = {}
    failures: list[StepFailure] = []
    while engine.has_unfinished_requests():
        try:
            outs = engine.step()
        except RuntimeError as e:
            failures.append(engine.step_failed(e))
            continue
        finals.update({o.request_id: o for o in outs if o.finished})
    return finals, failures


def _tokens(finals: dict[str, Any]) -> dict[str, list[int]]:
    return {rid: list(o.outputs[0].token_ids) for rid, o in finals.items()}


def _run(engine: LLMEngine, ids: str) -> dict[str, list[int]]:
    for rid in ids:
        engine.add_request(rid, PROMPTS[rid], GREEDY)
    finals, failures = _drain(engine)
    assert not failures
    return _tokens(finals)


def _assert_idle_clean(engine: LLMEngine) -> None:
    """Nothing tracked, every block free, KV invariants hold."""
    core = engine.engine_core
    core.check_integrity()  # asserts every block is free when idle
    assert core.scheduler.kv_cache_manager.is_idle_clean()
    assert not core.scheduler.requests and not engine.output_processor.states
    # the runner keeps finished requests' rows until the next step tells it to drop them
    held = set(core.model_runner.input_batch.req_id_to_row)
    assert held <= core.scheduler.finished_req_ids


@pytest.fixture(scope="module")
def reference(tiny_models) -> dict[str, list[int]]:  # noqa: ANN001
    """Greedy tokens of A, B, C on an engine that never fails."""
    return _run(_engine(tiny_models), "ABC")


def fail_batches_with(
    engine: LLMEngine, seam: str, request_id: str, at: int = 1, times: int = 1
) -> list[int]:
    """Make the runner's ``seam`` (``launch_forward``: before the forward pass, when the
    step's blocks are allocated but not written; ``resolve``: after it) raise RuntimeError for
    the ``at``-th batch holding ``request_id`` and the ``times - 1`` next ones. Returns a list
    that counts the raises."""
    runner = engine.engine_core.model_runner
    real = getattr(runner, seam)
    seen, raised = [0], []

    def flaky(arg: Any, *rest: Any) -> Any:
        ids = arg.num_scheduled_tokens if seam == "launch_forward" else arg.req_ids
        if request_id in ids:
            seen[0] += 1
            if at <= seen[0] < at + times:
                raised.append(seen[0])
                raise RuntimeError("injected fault")
        return real(arg, *rest)

    setattr(runner, seam, flaky)  # the executor looks the runner's methods up at each call
    return raised


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(
    "seam,at", [("launch_forward", 1), ("resolve", 1), ("launch_forward", 3), ("resolve", 4)]
)
def test_failed_step_ends_its_requests_and_engine_serves_on(
    tiny_models,  # noqa: ANN001
    reference: dict[str, list[int]],
    async_scheduling: bool,
    seam: str,
    at: int,
) -> None:
    """A and B run (C waits for a slot); a step holding A raises: A and B end with the error,
    C, never scheduled, runs to the reference tokens; no block leaks; A and B sent again get
    the reference tokens too (at=1 with launch_forward: the failed prefill's blocks were
    registered in the prefix cache but never written, so the cache must forget them)."""
    engine = _engine(tiny_models, async_scheduling=async_scheduling)
    _fault_and_recover(engine, reference, seam, at)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("seam", ["launch_forward", "resolve"])
def test_failed_step_with_the_host_kv_tier(
    tiny_models,  # noqa: ANN001
    reference: dict[str, list[int]],
    async_scheduling: bool,
    seam: str,
) -> None:
    """The same with the host tier on (``kv_offloading_size``): the saves of the failed step
    (blocks maybe never written) leave the tier, nothing stays in flight, and the requests
    sent again get the reference tokens."""
    from pagedllm.core.sched.offload import OffloadScheduler

    engine = _engine(tiny_models, async_scheduling=async_scheduling, kv_offloading_size=0.01)
    _fault_and_recover(engine, reference, seam, 1)
    (tier,) = [c for c in engine.engine_core.scheduler.connectors if c.name == "offload"]
    assert isinstance(tier, OffloadScheduler)
    assert not tier.busy and not tier.landing and not tier.planned.loads
    assert tier.saved_blocks > 0


def test_failed_step_with_the_hybrid_kv_manager(tiny_models) -> None:  # noqa: ANN001
    """The same with sliding-window layers (Gemma 3: the hybrid manager, several KV groups
    in one pool with a null block, a prefix cache per group)."""

    def gemma(arch: str) -> str:
        return tiny_models("gemma3")

    reference = _run(_engine(gemma, num_gpu_blocks_override=1024), "ABC")
    engine = _engine(gemma, num_gpu_blocks_override=1024)
    assert type(engine.engine_core.scheduler.kv_cache_manager).__name__ == "HybridKVCacheManager"
    _fault_and_recover(engine, reference, "launch_forward", 1)


def _fault_and_recover(
    engine: LLMEngine, reference: dict[str, list[int]], seam: str, at: int
) -> None:
    """A, B and C sent (max_num_seqs 2: C waits); the ``at``-th batch holding A fails at
    ``seam``; the checks of the test above."""
    raised = fail_batches_with(engine, seam, "A", at=at)
    for rid in "ABC":
        engine.add_request(rid, PROMPTS[rid], GREEDY)
    finals, failures = _drain(engine)
    assert raised == [at] and len(failures) == 1
    (failure,) = failures
    assert sorted(failure.request_ids) == ["A", "B"] and not failure.dead
    assert "injected fault" in failure.message
    assert set(finals) == {"C"} and _tokens(finals)["C"] == reference["C"]
    _assert_idle_clean(engine)
    assert engine.engine_core.consecutive_failures == 0  # C's steps completed
    assert _run(engine, "AB") == {"A": reference["A"], "B": reference["B"]}
    _assert_idle_clean(engine)


def test_failed_steps_in_a_row_kill_the_engine(tiny_models) -> None:  # noqa: ANN001
    """Every step holding a marked request fails: the count of failures in a row grows with
    each one and a step that completes resets it; at MAX_CONSECUTIVE_STEP_FAILURES in a row
    the failure says the engine is dead and names every request, waiting ones too."""
    assert MAX_CONSECUTIVE_STEP_FAILURES == 3
    engine = _engine(tiny_models)
    raised = fail_batches_with(engine, "launch_forward", "A", times=100)

    def one_failure(ids: str) -> StepFailure:
        for rid in ids:
            engine.add_request(rid, PROMPTS[rid], GREEDY)
        finals, failures = _drain(engine)
        assert len(failures) == 1 and not finals
        return failures[0]

    assert not one_failure("A").dead
    assert not one_failure("A").dead
    assert engine.engine_core.consecutive_failures == 2
    assert _run(engine, "B") and engine.engine_core.consecutive_failures == 0
    assert not one_failure("A").dead and not one_failure("A").dead
    _assert_idle_clean(engine)
    engine.add_request("A", PROMPTS["A"], GREEDY)
    engine.add_request("B", PROMPTS["B"], GREEDY)
    engine.add_request("C", PROMPTS["C"], GREEDY)  # waits (max_num_seqs 2)
    with pytest.raises(RuntimeError, match="injected fault") as info:
        engine.step()
    failure = engine.step_failed(info.value)
    assert failure.dead and len(raised) == 5
    assert "3 steps failed in a row" in failure.message
    assert sorted(failure.request_ids) == ["A", "B", "C"]


def test_a_waiting_request_that_fails_every_step_is_ended(tiny_models) -> None:  # noqa: ANN001
    """``schedule()`` raises while request P waits (before anything runs): the first failure
    ends nothing (nothing ran), the second ends every request, P and B, and the engine
    serves C."""
    engine = _engine(tiny_models)
    scheduler = engine.engine_core.scheduler
    real = scheduler.schedule

    def schedule() -> Any:
        if "P" in scheduler.requests:
            raise RuntimeError("injected fault")
        return real()

    scheduler.schedule = schedule
    engine.add_request("P", PROMPTS["A"], GREEDY)
    engine.add_request("B", PROMPTS["B"], GREEDY)
    finals, failures = _drain(engine)
    assert [f.request_ids for f in failures] == [[], ["P", "B"]]
    assert not any(f.dead for f in failures) and not finals
    assert engine.engine_core.consecutive_failures == 2
    assert _run(engine, "C") and engine.engine_core.consecutive_failures == 0
    _assert_idle_clean(engine)


def test_a_recovery_that_fails_kills_the_engine(tiny_models) -> None:  # noqa: ANN001
    """If the workers cannot be reset (a broken executor raises), the first failure is
    fatal."""
    engine = _engine(tiny_models)
    fail_batches_with(engine, "launch_forward", "A")

    def broken() -> None:
        raise RuntimeError("the executor is broken: rank 0 died")

    engine.engine_core.executor.reset_requests = broken
    engine.add_request("A", PROMPTS["A"], GREEDY)
    with pytest.raises(RuntimeError, match="injected fault") as info:
        engine.step()
    failure = engine.step_failed(info.value)
    assert failure.dead and failure.request_ids == ["A"]
    assert "could not recover" in failure.message


def test_detokenizer_error_ends_only_its_request(
    tiny_models,  # noqa: ANN001
    reference: dict[str, list[int]],
) -> None:
    """A's incremental detokenizer raises at its third step: A ends with the error (its last
    output finished, 'abort', ``error`` set) and is aborted in the engine core (its blocks
    freed at once); B, in the same steps, gets the reference tokens."""
    engine = _engine(tiny_models)
    for rid in "AB":
        engine.add_request(rid, PROMPTS[rid], GREEDY)
    detok = engine.output_processor.states["A"].seqs[0].detokenizer
    assert isinstance(detok, IncrementalDetokenizer)
    real, calls = detok.update, [0]

    def update(token_ids: list[int], **kw: Any) -> str | None:
        calls[0] += 1
        if calls[0] == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected fault")
        return real(token_ids, **kw)

    detok.update = update
    finals: dict[str, Any] = {}
    a_gone_while_b_ran = False
    while engine.has_unfinished_requests():
        outs = engine.step()
        finals.update({o.request_id: o for o in outs if o.finished})
        if "A" in finals and "B" not in finals:  # aborted in the core at once
            a_gone_while_b_ran = "A" not in engine.engine_core.scheduler.requests
    a = finals["A"]
    assert a.error is not None and "injected fault" in a.error
    assert a.outputs[0].finish_reason == "abort" and calls[0] == 3 and a_gone_while_b_ran
    assert finals["B"].error is None and _tokens(finals)["B"] == reference["B"]
    _assert_idle_clean(engine)


def test_offline_llm_raises_then_serves_on(
    tiny_models,  # noqa: ANN001
    reference: dict[str, list[int]],
) -> None:
    """``LLM.generate`` raises the step's exception; the same LLM then generates the
    reference tokens, every block free."""
    llm = LLM(tiny_models("llama"), dtype="float32", max_model_len=128, seed=0,
              num_gpu_blocks_override=64, max_num_seqs=2)  # fmt: skip
    fail_batches_with(llm.llm_engine, "resolve", "0", at=2)
    prompts = [PROMPTS["A"], PROMPTS["B"]]
    with pytest.raises(RuntimeError, match="injected fault"):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    _assert_idle_clean(llm.llm_engine)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [reference["A"], reference["B"]]
    _assert_idle_clean(llm.llm_engine)
