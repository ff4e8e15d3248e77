"""``--cpu-threads`` and ``--cpu-threads-bind`` (``pagedllm/utils/cpus.py``,
``pagedllm/worker/cpu_threads.py``): the CPU lists each rank is bound to, bad values refused
with the field named, and an engine (in its own process, so the binding does not leak into
the test process) whose model runs on the threads and CPUs asked for, in-process and as
tensor-parallel ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pagedllm.config import DeviceConfig
from pagedllm.utils.cpus import cpus_for_rank, parse_cpu_list

USABLE = sorted(os.sched_getaffinity(0))


def test_cpu_lists() -> None:
    assert parse_cpu_list("0-3,8") == [0, 1, 2, 3, 8]
    assert parse_cpu_list("2, 1,2") == [1, 2]
    assert cpus_for_rank("none", 0, 2) is None
    assert cpus_for_rank("0,2|1,3", 1, 2) == [1, 3]
    per = max(1, len(USABLE) // 2)
    assert cpus_for_rank("auto", 0, 2) == USABLE[:per]
    assert cpus_for_rank("auto", 1, 2) == (USABLE[per : 2 * per] or USABLE)
    assert cpus_for_rank("auto", 0, 1) == USABLE
    with pytest.raises(ValueError, match="2 CPU lists for 3 ranks"):
        cpus_for_rank("0|1", 0, 3)


@pytest.mark.parametrize("bind", ["3-1", "a", "0-", "0,,1", "1|x"])
def test_bad_bind_is_refused_with_the_field_named(bind: str) -> None:
    with pytest.raises(ValueError, match="cpu_threads_bind"):
        DeviceConfig(cpu_threads_bind=bind)


def test_bad_thread_count_is_refused_with_the_field_named() -> None:
    with pytest.raises(ValueError, match="cpu_threads"):
        DeviceConfig(cpu_threads=0)


_SCRIPT = """
import json, os, sys, torch
from pagedllm import LLM, SamplingParams
kw = json.loads(sys.argv[2])
llm = LLM(sys.argv[1], dtype="float32", device="cpu", max_model_len=128, **kw)
out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
ex = llm.llm_engine.engine_core.executor
if hasattr(ex, "runner"):  # in this process: its threads and CPUs
    seen = [(torch.get_num_threads(), sorted(os.sched_getaffinity(0)))]
else:  # worker processes: their CPUs (/proc), as "0-1" lists
    seen = [next(x.split()[1] for x in open(f"/proc/{pid}/status")
                 if x.startswith("Cpus_allowed_list")) for pid in ex.pids]
print(json.dumps({"tokens": list(out[0].outputs[0].token_ids), "seen": seen}))
"""


def _run(model: str, **kw) -> dict:  # noqa: ANN003
    res = subprocess.run(
        [sys.executable, "-c", _SCRIPT, model, json.dumps(kw)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_engine_runs_on_the_threads_and_cpus_asked_for(tiny_models) -> None:  # noqa: ANN001
    model = tiny_models("llama")
    plain = _run(model)
    got = _run(model, cpu_threads=1, cpu_threads_bind=f"{USABLE[-1]}")
    assert got["tokens"] == plain["tokens"]
    assert got["seen"] == [[1, [USABLE[-1]]]]


def test_tensor_parallel_ranks_bound_to_their_cpus(tiny_models) -> None:  # noqa: ANN001
    """bind "auto" at TP 2: each rank's worker on its own half of the usable CPUs (both on
    all of them when there is one CPU), the tokens those of an unbound run."""
    if len(USABLE) < 2:
        pytest.skip("needs two usable CPUs")
    model = tiny_models("llama")
    plain = _run(model, tensor_parallel_size=2)
    got = _run(model, tensor_parallel_size=2, cpu_threads_bind="auto")
    assert got["tokens"] == plain["tokens"]
    per = len(USABLE) // 2
    want = [USABLE[:per], USABLE[per : 2 * per]]
    assert [parse_cpu_list(x) for x in got["seen"]] == want


def _threads_and_cpus(core) -> tuple[int, list[int]]:  # noqa: ANN001 - in a core process
    import torch

    return torch.get_num_threads(), sorted(os.sched_getaffinity(0))


@pytest.mark.parametrize("bind", ["none", "auto"])
def test_data_parallel_cores_share_the_host(tiny_models, bind) -> None:  # noqa: ANN001
    """Two data-parallel cores on the CPU: each runs on its share of the host, as two
    tensor-parallel ranks do: half the usable CPUs' threads unbound, its own half bound
    ("auto"), not every core on every CPU (their threads oversubscribed the host)."""
    if len(USABLE) < 2:
        pytest.skip("needs two usable CPUs")
    from pagedllm import LLM

    if "OMP_NUM_THREADS" in os.environ and bind == "none":
        pytest.skip("OMP_NUM_THREADS decides the thread count")
    llm = LLM(tiny_models("llama"), dtype="float32", device="cpu", max_model_len=128,
              data_parallel_size=2, cpu_threads_bind=bind)  # fmt: skip
    engine = llm.llm_engine
    try:
        seen = [engine._run(c.call_in_core(_threads_and_cpus)) for c in engine.llm.cores]
    finally:
        engine.shutdown()
    per = len(USABLE) // 2
    assert [threads for threads, _ in seen] == [per, per]
    if bind == "auto":
        assert [cpus for _, cpus in seen] == [USABLE[:per], USABLE[per : 2 * per]]
