"""The KV seam takes a second user without a change to the scheduler or the model runner: a
recording connector, registered by name, sees every request and step at its hooks, its
per-step metadata reaches its worker role and the worker's report comes back to it, and the
tokens equal the engine's without it (also beside KV-Compress, and when it shortens chunks as
a loading tier would)."""

from __future__ import annotations

from typing import Any

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.core.sched.connector import (
    KV_CONNECTORS,
    KVConnectorScheduler,
    register_kv_connector,
)
from pagedllm.worker.kv_connector import KVConnectorWorker

PROMPTS = [[3 + (7 * i + j) % 200 for j in range(20 + 9 * i)] for i in range(4)]


class RecorderScheduler(KVConnectorScheduler):
    """Records its hooks; plans, each step, the ids and token counts it saw scheduled."""

    name = "recorder"
    chunk = None  # tokens a request may compute a step (a loading tier's cap), None: all

    def __init__(self, context: Any) -> None:
        super().__init__(context)
        self.added: list[str] = []
        self.freed: list[str] = []
        self.planned: list[dict[str, int]] = []
        self.landed: list[tuple[dict, Any]] = []

    def add_request(self, request: Any) -> None:
        self.added.append(request.request_id)

    def on_free(self, request: Any) -> None:
        self.freed.append(request.request_id)

    def num_new_tokens(self, request: Any, num_new: int) -> int:
        return num_new if self.chunk is None else min(num_new, self.chunk)

    def build_metadata(self, num_scheduled: Any, new_req_ids: Any) -> dict[str, int]:
        plan = dict(num_scheduled)
        self.planned.append(plan)
        return plan

    def update(self, metadata: Any, output: Any) -> None:
        self.landed.append((metadata, output))


class ChunkingRecorder(RecorderScheduler):
    chunk = 8


class RecorderWorker(KVConnectorWorker):
    """Reports, each step, the tokens of the step it saw before and after the forward pass."""

    name = "recorder"

    def __init__(self) -> None:
        self.seen: list[int] = []

    def before_forward(self, so: Any, metadata: Any, batch: Any) -> None:
        assert metadata == so.num_scheduled_tokens  # the plan is the step's
        self.seen.append(int(batch.n_sched.sum()))

    def after_forward(self, so: Any, metadata: Any) -> Any:
        return {"tokens": sum(metadata.values())} if metadata else None


@pytest.fixture
def recorder():
    """Register the recording connector for one test."""
    saved = dict(KV_CONNECTORS)
    worker = f"{__name__}:RecorderWorker"
    register_kv_connector("recorder", f"{__name__}:RecorderScheduler", worker)
    register_kv_connector("chunking", f"{__name__}:ChunkingRecorder", worker)
    yield
    KV_CONNECTORS.clear()
    KV_CONNECTORS.update(saved)


def _generate(path: str, **kw: Any) -> tuple[LLM, list[list[int]]]:
    llm = LLM(path, dtype="float32", max_model_len=256, max_num_batched_tokens=64, **kw)
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    return llm, [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("kvc", [False, True])
@pytest.mark.parametrize("name", ["recorder", "chunking"])
def test_a_second_connector_attaches_at_the_hooks(tiny_models, recorder, kvc, name):
    path = tiny_models("llama")
    kvc_kw = dict(enable_kvc=True, max_cache_tokens=12) if kvc else {}
    _, expected = _generate(path, **kvc_kw)
    llm, tokens = _generate(path, kv_connectors=(name,), **kvc_kw)
    assert tokens == expected
    core = llm.llm_engine.engine_core
    roles = core.scheduler.connectors
    assert [r.name for r in roles] == ["recorder"] + ["kvcompress"] * kvc  # (it rewrites last)
    sched_role, worker_role = roles[0], core.model_runner.connectors[0]
    assert sorted(sched_role.added) == sorted(sched_role.freed) and len(sched_role.added) == 4
    # every step's plan reached the worker role, and its report came back with the plan
    assert worker_role.seen == [sum(p.values()) for p in sched_role.planned if p]
    for plan, report in sched_role.landed:
        assert report == ({"tokens": sum(plan.values())} if plan else None)
    assert len(sched_role.landed) == len(sched_role.planned)
    if name == "chunking":  # no step computed more than 8 tokens of a request
        assert max(n for p in sched_role.planned for n in p.values()) == 8
    core.check_integrity()


def test_unknown_connector_is_a_clear_error(tiny_models):
    with pytest.raises(ValueError, match="unknown KV connector 'nope'"):
        LLM(tiny_models("llama"), dtype="float32", max_model_len=256, kv_connectors=("nope",))
