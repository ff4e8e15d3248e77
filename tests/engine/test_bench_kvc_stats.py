"""The KV-Compress diagnostics ``pagedllm bench throughput`` reports: eviction time by step
kind, and how uneven the heads' lengths are."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.bench.roofline import StepRecord
from pagedllm.bench.throughput import _compress_split, device_gaps, head_len_stats


def test_eviction_time_split_by_step_kind():
    """Evictions ride on the step that planned them: their time is counted in its kind
    (prompt or decode-only) and taken out of the decode-only steps' mean."""
    steps = [StepRecord([5, 1], [5, 9]), StepRecord([1, 1], [6, 10]), StepRecord([1, 1], [7, 11])]
    device = [0.010, 0.004, 0.002]
    got = _compress_split(steps, device, [0.003, 0.001, 0.001], [0, 1, 1])
    assert got["compress_s_prefill_steps"] == pytest.approx(0.003)
    assert got["compress_s_decode_steps"] == pytest.approx(0.002)
    assert got["decode_steps_with_evictions"] == 1
    assert got["device_ms_per_decode_step_without_evictions"] == pytest.approx(2.0)  # (2 + 2) / 2
    assert _compress_split(steps, device[:2], [0.003], [0]) == {}


def test_device_gaps_between_overlapping_work():
    """The device's idle time in a profiled window: overlapping kernels (two streams) count
    once, only the time between them is idle, per step, and the largest gaps first."""
    got = device_gaps([(30, 31), (2, 6), (0, 4), (8, 10)], steps=2)  # (any order)
    assert got["device_busy_in_window"] == pytest.approx(9 / 31)
    assert got["device_idle_ms_per_step"] == pytest.approx(0.022 / 2)
    assert got["device_largest_gaps_ms"] == pytest.approx([0.020, 0.002])
    contained = device_gaps([(0, 10), (2, 3), (4, 5)], steps=1)  # inside a longer one: no gap
    assert contained["device_busy_in_window"] == 1.0 and contained["device_largest_gaps_ms"] == []
    assert device_gaps([], steps=3) == {"device_busy_in_window": None}


def test_head_length_statistics():
    """Quantiles over every sampled head, and each layer's longest head over its mean."""
    # 2 rows x 2 layers x 2 KV heads: layer 0 holds [100, 100, 100, 900] -> 3.0; layer 1 even
    x = np.array([[[100, 100], [50, 50]], [[100, 900], [50, 50]]])
    got = head_len_stats([x])
    assert got["layer_max_over_mean"] == pytest.approx((3.0 + 1.0) / 2)
    assert got["head_len_max"] == 900 and got["head_len_samples"] == 1
    assert got["head_len_mean"] == pytest.approx(x.mean())
    assert got["head_len_p50_p90_p99"][0] == pytest.approx(75.0)
    assert head_len_stats([]) == {}


def test_bench_throughput_reads_head_lengths_and_profiles_kernels(tiny_models, tmp_path):  # noqa: ANN001
    """A KV-Compress run samples the lengths its kernels read (the runner's, not the
    scheduler's view, which lags an eviction in flight): on average a head within the budget
    plus the protected window and the tokens decoded since, none past the tokens computed;
    and ``--kernel-profile`` times the window of steps it names."""
    import json

    from pagedllm.entrypoints.cli import main

    out = tmp_path / "kvc.json"
    budget, window = 16, 4
    assert main(["bench", "throughput", "--model", tiny_models("llama"), "--device", "cpu",
                 "--dtype", "float32", "--max-model-len", "256", "--num-prompts", "3",
                 "--input-len", "96", "--output-len", "70", "--enable-kvc",
                 "--max-cache-tokens", str(budget), "--protected-window-size", str(window),
                 "--kernel-profile", "10:5", "--output-json", str(out)]) == 0  # fmt: skip
    r = json.loads(out.read_text())
    assert r["head_len_samples"] >= 1
    # compressed after the prompt (96 tokens): a request keeps budget + window KVs a head on
    # average (a head may keep more, another fewer), each head then grows by one a step
    assert 0 < r["head_len_mean"] <= budget + window + 70 < 96
    assert r["head_len_max"] <= 96 + 70
    kp = r["kernel_profile"]
    assert kp["steps"] == 5 and kp["first_step"] == 10 and kp["decode_only_steps"] == 5
    assert kp["running_mean"] == 3 and kp["device_ms_per_step"] > 0
    assert kp["wall_ms_per_step"] > 0  # (the device's gaps only on a GPU)
    assert any("mm" in k["name"] or "linear" in k["name"] for k in kp["top_ms_per_step"])


def test_kernel_table_counts_each_kinds_bytes(tiny_models):  # noqa: ANN001
    """The per-kernel table's least traffic, from the model's layers, on a hand count of the
    tiny Llama (hidden 64, MLP 128, 2 layers, 4 heads / 2 KV heads of 16, vocabulary 512,
    float32): every linear weight once for the GEMMs, the live KV for attention, and each
    kind's fraction is its limit over its time at the given rates."""
    from pagedllm import LLM
    from pagedllm.bench.kernel_table import kernel_costs, kernel_kind, kernel_table
    from pagedllm.bench.roofline import model_cost

    llm = LLM(tiny_models("llama"), device="cpu", dtype="float32", max_model_len=128)
    model = llm.llm_engine.engine_core.model_runner.model
    kc = kernel_costs(model, model_cost(model, torch.float32), 4)
    H, inter, layers, heads, kvh, d, vocab = 64, 128, 2, 4, 2, 16, 512
    lin = layers * (H * (heads + 2 * kvh) * d + heads * d * H + H * 2 * inter + inter * H)
    assert kc.linear_params == lin and kc.linear_weight_bytes == 4 * lin
    assert kc.head_params == vocab * H
    assert kc.norm_bytes == (2 * layers + 1) * 4 * H * 4  # two pre-norms a layer + the final
    assert kc.act_bytes == layers * 3 * inter * 4
    kv_token = layers * 2 * kvh * d * 4
    assert kc.cost.kv_bytes_per_token == kv_token

    # one decode step of two requests at 10 and 20 tokens of context
    steps = [StepRecord(num_tokens=[1, 1], seq_lens=[10, 20])]
    bw, peak = 1e9, 1e12
    rows = {r["kind"]: r for r in kernel_table(
        {"attention": 0.5, "gemm": 2.0, "other": 0.1, "sampling": 0.05}, steps, kc, bw,
        peak)}  # fmt: skip
    att = rows["attention"]
    assert att["bytes_per_step"] == 30 * kv_token + 2 * layers * 2 * heads * d * 4
    assert att["fraction_of_limit"] == pytest.approx(1e3 * att["bytes_per_step"] / bw / 0.5)
    assert att["bound"] == "memory"
    gemm = rows["gemm"]
    assert gemm["flops_per_step"] == 2 * (2 * lin + 2 * vocab * H)
    assert gemm["bytes_per_step"] > kc.linear_weight_bytes + vocab * H * 4
    assert "bytes_per_step" not in rows["other"] and rows["other"]["ms_per_step"] == 0.1
    assert rows["sampling"]["bytes_per_step"] == 2 * vocab * 4  # a row of logits a request
    assert list(rows) == ["gemm", "attention", "other", "sampling"]  # slowest first
    assert kernel_kind("nvjet_tst_128x64_64x8") == "gemm"
    assert kernel_kind("_rope_kernel") == "rope"
    assert kernel_kind("_unified_kernel") == "attention"
    assert kernel_kind("Memcpy DtoD") == "other"
    greedy = "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<c10::BFloat16, at::native::ArgMaxOps<float>"  # noqa: E501
    assert kernel_kind(greedy) == "sampling"
