"""The block map the dashboard draws (``core/kv_cache/block_map.py``, each manager's
``block_map``) and the engine snapshot around it (``engine/snapshot.py``): the states agree
with the managers' own accounting on real engines (paged, hybrid sliding window, per-head
KV-Compress), and the per-head lengths show evictions."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pagedllm.core.kv_cache.block_map import (
    CACHED,
    FREE,
    RESERVED,
    SHARED,
    USED,
    build_block_map,
    downsample,
)
from pagedllm.engine.snapshot import engine_snapshot
from pagedllm.sampling_params import SamplingParams


def test_build_block_map_worked_example() -> None:
    m = build_block_map(6, [("a", [0, 1]), ("b", [1, 2])], cached=[1, 4], reserved=[5])
    assert m.state.tolist() == [USED, SHARED, USED, FREE, CACHED, RESERVED]
    assert m.owner.tolist() == [0, 1, 1, -1, -1, -1]
    assert m.request_ids == ("a", "b") and m.request_blocks.tolist() == [2, 2]
    assert m.counts() == {"free": 1, "cached": 1, "used": 2, "shared": 1, "reserved": 1}


def test_a_request_in_two_groups_is_one_owner() -> None:
    m = build_block_map(4, [("a", [0]), ("a", [2])])
    assert m.request_ids == ("a",) and m.request_blocks.tolist() == [2]
    assert m.state.tolist() == [USED, FREE, USED, FREE]


def test_downsample_worked_example() -> None:
    m = build_block_map(5, [("a", [0]), ("b", [4])], cached=[3])
    k, cells, owner = downsample(m, 3)
    assert k == 2 and cells.tolist() == [USED, CACHED, USED]
    assert owner.tolist() == [0, -1, 1]
    k, cells, _ = downsample(m, 100)  # fewer blocks than cells: one block each
    assert k == 1 and cells.tolist() == m.state.tolist()


def _run(llm, prompts: list[list[int]], params: list[SamplingParams], steps: int):  # noqa: ANN001
    eng = llm.llm_engine
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        eng.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
    for _ in range(steps):
        eng.step()
    return eng.engine_core


def _check_against_manager(core) -> dict:  # noqa: ANN001
    kv = core.scheduler.kv_cache_manager
    kv.check_integrity()
    m = kv.block_map()
    c = m.counts()
    assert sum(c.values()) == kv.num_blocks
    # what the map calls free or cached is exactly what the manager can hand out
    assert c["free"] + c["cached"] == kv.num_free_blocks()
    snap = engine_snapshot(core, max_cells=64)
    json.dumps(snap, allow_nan=False)  # plain data: it travels pickled and as JSON
    assert len(snap["blocks"]["cells"]) <= 64
    rows = {r["id"]: r for r in snap["requests"]}
    for rid, n in zip(m.request_ids, m.request_blocks.tolist(), strict=True):
        assert rows[rid]["blocks"] == n
    return snap


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_paged_and_hybrid_maps_match_the_managers(tiny_models, arch: str) -> None:  # noqa: ANN001
    from pagedllm import LLM

    llm = LLM(tiny_models(arch), dtype="float32", max_model_len=256, num_gpu_blocks_override=96,
              block_size=16, device="cpu")  # fmt: skip
    shared = list(range(10, 74))  # four full blocks every prompt shares
    prompts = [shared + [100 + i] * (5 + 7 * i) for i in range(3)]
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], sp, use_tqdm=False)  # caches the prefix
    core = _run(llm, prompts, [sp] * 3, steps=3)
    snap = _check_against_manager(core)
    c = snap["blocks"]["counts"]
    assert c["shared"] >= 4 and c["used"] > 0  # the prefix is held by all three
    assert {r["status"] for r in snap["requests"]} == {"running"}
    assert all(r["cached_tokens"] == 64 for r in snap["requests"])
    assert snap["heads"] is None
    if arch == "gemma3":
        assert c["reserved"] == 1  # the hybrid manager's null block
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()
    snap = _check_against_manager(core)
    c = snap["blocks"]["counts"]
    assert c["used"] == c["shared"] == 0 and c["cached"] > 0 and snap["requests"] == []


def test_per_head_map_and_heads_show_evictions(tiny_models) -> None:  # noqa: ANN001
    from pagedllm import LLM

    llm = LLM(tiny_models("llama"), dtype="float32", max_model_len=512, enable_kvc=True,
              protected_window_size=8, kv_cache_memory_bytes=8 << 20, device="cpu")  # fmt: skip
    prompt = list(range(5, 300))
    params = [SamplingParams(max_tokens=30, ignore_eos=True, compression_rate=4.0),
              SamplingParams(max_tokens=30, ignore_eos=True)]  # fmt: skip
    core = _run(llm, [prompt, [7] + prompt[1:]], params, steps=4)
    snap = _check_against_manager(core)
    heads = snap["heads"]
    kv = core.scheduler.kv_cache_manager
    assert heads["layers"] * heads["kv_heads"] == kv.num_heads
    # only the request with a budget is on the heat map, and its KVs were evicted
    assert [r["id"] for r in heads["requests"]] == ["r0"]
    lens = np.array(heads["requests"][0]["lens"])
    assert lens.shape == (heads["layers"], heads["kv_heads"])
    assert lens.max() <= heads["requests"][0]["num_tokens"]
    kept = np.array(heads["kept"])
    assert (kept > 0).all() and kept.mean() < 0.5  # 4x: about a quarter kept (+ window)
    assert snap["stats"]["kvc_evicted_kvs"] > 0
    rows = {r["id"]: r for r in snap["requests"]}
    assert rows["r0"]["kvc"] == "4x" and rows["r1"]["kvc"] is None
    assert rows["r0"]["held_kvs"] < rows["r1"]["held_kvs"]
    # a pool too big to read whole: sampled at a stride, with the same exact counts
    full = kv.block_map()
    sampled = kv.block_map(full_limit=1000, samples=-(-kv.num_blocks // 10))
    assert sampled.stride == 10 and sampled.num_blocks == kv.num_blocks
    assert sampled.counts() == full.counts()
    assert (sampled.state == full.state[::10]).all() and (sampled.owner == -1).all()
    assert sampled.request_ids == full.request_ids
    assert (sampled.request_blocks == full.request_blocks).all()


def test_bench_report_frames_and_page(tiny_models, tmp_path) -> None:  # noqa: ANN001
    """``pagedllm bench throughput --kv-map-report``'s pieces: frames recorded between steps
    (the core's own ``step`` back afterwards), written as one page that carries them all and
    fetches nothing."""
    from pagedllm import LLM
    from pagedllm.dashboard.report import FrameRecorder, write_report

    llm = LLM(tiny_models("llama"), dtype="float32", max_model_len=512, enable_kvc=True,
              protected_window_size=8, kv_cache_memory_bytes=8 << 20, device="cpu")  # fmt: skip
    core = llm.llm_engine.engine_core
    with pytest.raises(ValueError, match="interval"):
        FrameRecorder(core, 0)
    rec = FrameRecorder(core, every_s=1e-6)  # a frame after every step
    sp = SamplingParams(max_tokens=12, ignore_eos=True, compression_rate=2.0)
    llm.generate([{"prompt_token_ids": list(range(5, 120))}] * 2, sp, use_tqdm=False)
    frames = rec.finish()
    assert "step" not in vars(core)  # recording over: the class's step again
    assert len(frames) >= 12 and frames[-1]["requests"] == []
    assert any(f["heads"]["requests"] for f in frames)
    path = write_report(tmp_path / "run.html", frames, "tiny")
    page = path.read_text()
    assert "window.PAGEDLLM_FRAMES = " in page and "/dashboard/static/" not in page
    data = page.split("window.PAGEDLLM_FRAMES = ", 1)[1].split(";</script>", 1)[0]
    states = json.loads(data.replace("<\\/", "</"))
    assert len(states) == len(frames) and states[-1]["history"][-1]["t"] == frames[-1]["time"]
    assert states[3]["history"][3]["step_ms"] > 0
    with pytest.raises(ValueError, match="frame"):
        write_report(tmp_path / "empty.html", [], "tiny")


def test_host_prefix_tier_in_the_snapshot(tiny_models) -> None:  # noqa: ANN001
    """With the host tier (``kv_offloading_size``) the snapshot lists it: the prefix blocks
    the device pool gave up are held in host blocks, drawn as cached cells."""
    from pagedllm import LLM

    llm = LLM(tiny_models("llama"), dtype="float32", max_model_len=256, device="cpu",
              num_gpu_blocks_override=24, max_num_seqs=2, kv_offloading_size=0.01)  # fmt: skip
    core = llm.llm_engine.engine_core
    (tier,) = [t for t in engine_snapshot(core)["host"] if t["name"] == "host prefix tier"]
    assert tier["used"] == 0 and tier["total"] > 0
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    for i in range(3):  # 10 blocks each into a 24-block pool: the first ones are pushed out
        llm.generate([{"prompt_token_ids": [50 + i] * 150}], sp, use_tqdm=False)
    (tier,) = [t for t in engine_snapshot(core)["host"] if t["name"] == "host prefix tier"]
    assert tier["used"] >= 9 and len(tier["cells"]) <= 1024
    assert tier["cells"].count(CACHED) > 0
