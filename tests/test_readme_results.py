"""The README's Benchmark A numbers are the result files' numbers (a re-run that changes the
files without the README, or a README edit without a re-run, fails here)."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _row(readme: str, label: str) -> str:
    return next(line for line in readme.splitlines() if line.startswith(f"| {label}"))


def test_benchmark_a_table_quotes_the_result_files() -> None:
    readme = (ROOT / "README.md").read_text()
    named = re.findall(r"benchmarks/results/(gpu_bench-a_[\w.-]+\.json)", readme)
    assert "gpu_bench-a_NVIDIA_H100_80GB_HBM3.json" in named
    for name in named:
        assert (ROOT / "benchmarks" / "results" / name).exists(), name
    h100 = json.loads(
        (ROOT / "benchmarks/results/gpu_bench-a_NVIDIA_H100_80GB_HBM3.json").read_text()
    )
    assert h100["device"] in " ".join(readme.split())  # the device is named
    rows = {
        "pagedllm_cuda_graphs": "pagedllm, CUDA graphs, async",
        "pagedllm_cuda_graphs_sync": "pagedllm, CUDA graphs, synchronous",
    }
    for key, label in rows.items():
        run = h100[key]
        cells = f"| {run['output_tokens_per_s']:,.0f} | {run['roofline_fraction']:.1%} |"
        assert cells in _row(readme, label), (label, cells)
    peers = h100["peers"]
    assert f"| {peers['hf_generate_batch']:,.0f} |" in _row(
        readme, "HF transformers `generate_batch`"
    )
    assert f"| {peers['hf_generate']:,.0f} |" in _row(readme, "HF transformers `generate` ")
    h200 = json.loads((ROOT / "benchmarks/results/gpu_bench-a_NVIDIA_H200.json").read_text())
    text = " ".join(readme.split())
    run = h200["pagedllm_cuda_graphs"]
    quoted = f"{run['output_tokens_per_s']:,.0f} output tok/s, {run['roofline_fraction']:.1%}"
    assert quoted in text, quoted


def test_benchmarks_readme_latest_benchmark_a_is_the_h100_file() -> None:
    text = (ROOT / "benchmarks" / "README.md").read_text()
    latest = text[text.index("Latest Benchmark A") :]
    assert latest.split("\n")[0].find("gpu_bench-a_NVIDIA_H100_80GB_HBM3.json") > 0
    d = json.loads((ROOT / "benchmarks/results/gpu_bench-a_NVIDIA_H100_80GB_HBM3.json").read_text())
    run, peers = d["pagedllm_cuda_graphs"], d["peers"]
    cells = (
        f"| {run['output_tokens_per_s']:,.0f} "
        f"| {run['output_tokens_per_s'] / peers['hf_generate_batch']:.1f}× "
        f"| {run['output_tokens_per_s'] / peers['hf_generate']:.1f}× "
        f"| {run['roofline_fraction']:.1%} "
        f"| {run['wall_ms_per_step']:.2f} / {run['device_ms_per_step']:.2f} |"
    )
    assert cells in _row(latest, "pagedllm, CUDA graphs, async"), cells
