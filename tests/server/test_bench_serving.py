"""``pagedllm bench serving`` against the live test server: 4 streamed prompts x 8 tokens."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from pagedllm.bench import serving
from tests.server.conftest import LiveServer


@pytest.mark.parametrize("endpoint,prompt_type", [("completions", "ids"), ("chat", "words")])
def test_bench_serving_fields(
    server: LiveServer, tmp_path: Path, endpoint: str, prompt_type: str
) -> None:
    parser = argparse.ArgumentParser()
    serving.add_arguments(parser)
    args = parser.parse_args(
        ["--base-url", f"{server.url}/v1", "--api-key", server.api_key,
         "--endpoint", endpoint, "--prompt-type", prompt_type, "--num-prompts", "4",
         "--input-len", "16", "--output-len", "8", "--concurrency", "2", "--warmup", "1",
         "--result-dir", str(tmp_path), "--result-name", "t"]
    )  # fmt: skip
    result = serving.run_benchmark(args)
    assert result["model"] == server.model
    saved = json.loads((tmp_path / "t.json").read_text())
    assert (tmp_path / "t.png").stat().st_size > 0
    s = saved["server"]
    assert s["num_requests"] == s["completed"] == 4 and s["failed"] == 0, s["errors"]
    assert s["total_output_tokens"] == 4 * 8  # ignore_eos: exactly max_tokens each
    assert s["total_input_tokens"] >= 4 * 16
    assert s["request_throughput"] > 0 and s["output_throughput"] > 0
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        st = s[key]
        assert st["mean"] > 0 and 0 < st["p50"] <= st["p99"], (key, st)
    assert s["ttft_ms"]["p99"] <= s["e2el_ms"]["p99"]
    for r in s["requests"]:
        assert r["output_tokens"] == 8 and 0 < r["ttft"] < r["latency"]
        assert len(r["itl"]) == r["chunks"] - 1
    assert saved["offline"] is None and saved["http_overhead"] is None
