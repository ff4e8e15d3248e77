"""The READMEs' benchmark numbers are the result files' numbers (a re-run that changes the files
without the READMEs, or a README edit without a re-run, fails here), every result file they
name exists, and no result file is named after a commit (git keeps the history)."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
BENCH_README = ROOT / "benchmarks" / "README.md"
D_FILES = [
    f"kvcompress_throughput_llama-3.1-8b_in6000_4096MiB{rates}_NVIDIA_H200.json"
    for rates in ("", "_cr64_cr4", "_cr2")
]


def _row(readme: str, label: str) -> str:
    return next(line for line in readme.splitlines() if line.startswith(f"| {label}"))


def _flat(text: str) -> str:
    return " ".join(text.split())


def _load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def test_benchmark_a_table_quotes_the_result_files() -> None:
    readme = (ROOT / "README.md").read_text()
    named = re.findall(r"benchmarks/results/(gpu_bench-a_[\w.-]+\.json)", readme)
    assert "gpu_bench-a_NVIDIA_H100_80GB_HBM3.json" in named
    for name in named:
        assert (RESULTS / name).exists(), name
    h100 = _load("gpu_bench-a_NVIDIA_H100_80GB_HBM3.json")
    assert h100["device"] in _flat(readme)  # the device is named
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
    run = _load("gpu_bench-a_NVIDIA_H200.json")["pagedllm_cuda_graphs"]
    quoted = f"{run['output_tokens_per_s']:,.0f} output tok/s, {run['roofline_fraction']:.1%}"
    assert quoted in _flat(readme), quoted


def test_benchmarks_readme_latest_benchmark_a_is_the_h100_file() -> None:
    text = BENCH_README.read_text()
    latest = text[text.index("Latest Benchmark A") :]
    assert latest.split("\n")[0].find("gpu_bench-a_NVIDIA_H100_80GB_HBM3.json") > 0
    d = _load("gpu_bench-a_NVIDIA_H100_80GB_HBM3.json")
    run, peers = d["pagedllm_cuda_graphs"], d["peers"]
    cells = (
        f"| {run['output_tokens_per_s']:,.0f} "
        f"| {run['output_tokens_per_s'] / peers['hf_generate_batch']:.1f}× "
        f"| {run['output_tokens_per_s'] / peers['hf_generate']:.1f}× "
        f"| {run['roofline_fraction']:.1%} "
        f"| {run['wall_ms_per_step']:.2f} / {run['device_ms_per_step']:.2f} |"
    )
    assert cells in _row(latest, "pagedllm, CUDA graphs, async"), cells


def test_benchmark_d_tables_quote_the_result_files() -> None:
    """Every rate of Benchmark D's table, in both READMEs, is its file's run; the KV-Compress
    runs of the later calls are compared with the first call's uncompressed run."""
    bench = BENCH_README.read_text()
    top = _flat((ROOT / "README.md").read_text())
    base = _load(D_FILES[0])["summary"]["uncompressed"]
    assert f"| {base['output_tokens_per_s']:,.0f} | 1.00x |" in _row(bench, "uncompressed |")
    rates = []
    for name in D_FILES:
        d = _load(name)
        assert d["args"]["num_prompts"] == 256 and d["args"]["input_len"] == 6000, name
        summary = d["summary"]
        tok = summary["uncompressed"]["output_tokens_per_s"]
        assert tok == base["output_tokens_per_s"], name  # one uncompressed run for all
        for key, run in summary.items():
            if key == "uncompressed":
                continue
            cr = int(key.removeprefix("kvc_cr"))
            rates.append(cr)
            cells = (
                f"| cr {cr} ({run['max_cache_tokens']:,}) | {run['output_tokens_per_s']:,.0f} "
                f"| {run['speedup_output']:.2f}x | {run['concurrent_seqs_mean']:.1f} / "
                f"{run['concurrent_seqs_peak']} |"
            )
            assert cells in _row(bench, f"cr {cr} ("), cells
            assert f"{run['speedup_output']:.2f}x at {cr}x" in top, (cr, run["speedup_output"])
    assert sorted(rates) == [2, 4, 8, 16, 32, 64]


def test_benchmark_d_h100_ceiling_table_quotes_its_file() -> None:
    """The H100 rows (the decode-free ceiling measured by the prompts-alone run) are the
    file's, and the top README quotes its speed-ups and fractions."""
    bench = BENCH_README.read_text()
    top = _flat((ROOT / "README.md").read_text())
    s = _load("kvcompress_throughput_llama-3.1-8b_in6000_4096MiB_NVIDIA_H100_80GB_HBM3.json")[
        "summary"
    ]
    base, pre = s["uncompressed"], s["prefill_only"]
    assert f"| {base['output_tokens_per_s']:,.0f} | 1.00x |" in _row(bench, "H100 uncompressed")
    ceiling = pre["decode_free_ceiling"]
    assert f"| {ceiling:.2f}x (the ceiling) |" in _row(bench, "H100 prompts alone")
    assert f"the prompts alone, {ceiling:.2f}x" in top
    for cr in (64, 8):
        run = s[f"kvc_cr{cr}"]
        assert run["fraction_of_ceiling"] == pytest.approx(
            base["elapsed_s"] / run["elapsed_s"] / ceiling
        )
        cells = (
            f"| {run['output_tokens_per_s']:,.0f} | {run['speedup_output']:.2f}x "
            f"| {run['fraction_of_ceiling']:.1%} | {run['concurrent_seqs_mean']:.1f} / "
            f"{run['concurrent_seqs_peak']} | {run['device_s_prefill_steps']:.2f} / "
            f"{run['device_s_decode_steps']:.2f} |"
        )
        assert cells in _row(bench, f"H100 cr {cr} ("), cells
        assert f"{run['speedup_output']:.2f}x at {cr}x" in top, cr


def test_host_tier_tables_quote_their_files() -> None:
    bench = _flat(BENCH_README.read_text())
    tables = (
        ("kv_offload_smollm2-135m-instruct-f32_Intel_Xeon_Processor.json", ""),
        ("kv_offload_qwen3-0.6b_NVIDIA_H100_80GB_HBM3.json", "Qwen3-0.6B, "),
        ("kv_offload_llama-3.1-8b_NVIDIA_H100_80GB_HBM3.json", "Llama-3.1-8B, "),
    )
    for name, shape in tables:
        d = _load(name)
        for mode, label in (("off", "tier off"), ("on", "tier on"), ("ceiling", "everything fits")):
            r = d["runs"][mode]
            row = (
                f"| {shape}{label} | {r['output_tokens_per_s']:.1f} "
                f"| {r['ttft_p50_s']:.3f} / {r['ttft_p99_s']:.3f} "
                f"| {r.get('offload_hit_tokens', 0):,} |"
            )
            assert row in bench, row
    cpu = _load(tables[0][0])["ratios"]
    quoted = (
        f"TTFT p50 is {cpu['ttft_p50_on_over_off']:.2f}x the tier-off run's and the throughput "
        f"{cpu['throughput_on_over_off']:.2f}x, {cpu['throughput_on_over_ceiling']:.1%}"
    )
    assert quoted in bench
    big = _load(tables[2][0])["ratios"]
    quoted = (
        f"TTFT p50 is {big['ttft_p50_on_over_off']:.2f}x the tier-off run's and the throughput "
        f"{big['throughput_on_over_off']:.2f}x, {big['throughput_on_over_ceiling']:.1%}"
    )
    assert quoted in bench
    small = _load(tables[1][0])["ratios"]
    quoted = f"TTFT p50 {small['ttft_p50_on_over_off']:.2f}x the tier-off run's (the ~1,000 tokens"
    assert quoted in bench
    assert f"throughput {small['throughput_on_over_off']:.2f}x, " in bench
    assert f"{small['throughput_on_over_ceiling']:.1%} of everything-fits" in bench


def test_disaggregation_tables_quote_their_files() -> None:
    """The transports' tables are their files' summaries (both transports of one call per
    file: the H100's two shapes, the H200's Qwen3-0.6B) and copy rates."""
    bench = _flat(BENCH_README.read_text())
    files = [
        ("Qwen3-0.6B", "pd_transfer_qwen3-0.6b_NVIDIA_H100_80GB_HBM3.json"),
        ("Llama-3.1-8B", "pd_transfer_llama-3.1-8b_NVIDIA_H100_80GB_HBM3.json"),
        ("Qwen3-0.6B", "pd_transfer_qwen3-0.6b_NVIDIA_H200.json"),
    ]
    for shape, name in files:
        d = _load(name)
        n = d["args"]["num_prompts"]
        for t in ("file", "buffer"):
            sm = d[t]["summary"]
            ref = "slowest_copy" if t == "file" else "device_copy"
            row = (
                f"| {shape} | {t} | {sm['producer_over_colocated_prefill']:.2f}x "
                f"| {sm['consumer_first_tokens_over_colocated']:.2f}x "
                f"| {sm['save_gb_s']:.1f} ({sm['save_over_' + ref]:.1%}) "
                f"| {sm['load_gb_s']:.1f} ({sm['load_over_' + ref]:.1%}) "
                f"| {sm['requests_equal']} of {n} |"
            )
            assert row in bench, row
        if shape == "Qwen3-0.6B":
            r = d["buffer"]["runs"]["consumer"]["copy_rates_gb_s"]
            assert (
                f"Qwen3-0.6B: file write / read {r['file_write']:.1f} / {r['file_read']:.1f}, "
                f"pinned host to device {r['host_to_device']:.0f}, device to device "
                f"{r['device_to_device']:,.0f} GB/s"
            ) in bench
    h200 = _load("pd_transfer_qwen3-0.6b_NVIDIA_H200.json")
    buf, fil = h200["buffer"]["summary"], h200["file"]["summary"]
    assert f"{buf['save_gb_s'] / fil['save_gb_s']:.0f}x (write)" in bench
    assert f"{buf['load_gb_s'] / fil['load_gb_s']:.0f}x (read)" in bench
    big = _load("pd_transfer_llama-3.1-8b_NVIDIA_H100_80GB_HBM3.json")["buffer"]["summary"]
    assert f"{big['requests_equal']} of 16 consumer requests" in bench
    assert f"after {big['mean_tokens_before_a_difference']:.0f} tokens on average" in bench
    mixed = _load("pd_mixed_SmolLM2-135M-Instruct_Intel_Xeon_Processor.json")["runs"]
    for col, pd in zip(mixed["colocated"], mixed["pd"]):
        row = (
            f"| {col['rate']:g} | {col['chat']['tpot_p99_s']:.3f} / {pd['chat']['tpot_p99_s']:.3f} "
            f"| {col['chat']['ttft_p99_s']:.2f} / {pd['chat']['ttft_p99_s']:.2f} "
            f"| {col['long']['ttft_p99_s']:.2f} / {pd['long']['ttft_p99_s']:.2f} |"
        )
        assert row in bench, row
    last_col, last_pd = mixed["colocated"][-1], mixed["pd"][-1]
    ratio = last_pd["chat"]["tpot_p99_s"] / last_col["chat"]["tpot_p99_s"]
    assert f"chat TPOT p99 at {ratio:.2f}x the colocated engine's" in bench


def test_cpu_table_and_overheads_quote_the_result_files() -> None:
    bench = BENCH_README.read_text()
    top = _flat((ROOT / "README.md").read_text())
    labels = {"tiny": "tiny", "smollm2": "SmolLM2-135M"}
    for model, dtype in itertools.product(labels, ("float32", "bfloat16")):
        d = _load(f"cpu_throughput_{model}_{dtype}_AMD_EPYC.json")
        e, ratio = d["engines"], d["ratios"]["pagedllm/vllm"]["output_tok_s"]
        cells = (
            f"| {e['pagedllm']['output_tok_s']:,.1f} | {e['vllm']['output_tok_s']:,.1f} "
            f"| {ratio:.2f}x |"
        )
        assert cells in _row(bench, f"{labels[model]}, {dtype}"), cells
        assert f"{ratio:.2f}x in {dtype}" in top, (model, dtype, ratio)
    costs = []
    for name, workload in (("a", "a"), ("b", "in128_out1024"), ("b", "in1024_out128")):
        s = _load(f"kvcompress_overhead_{name}_NVIDIA_H200.json")["runs"][workload]["summary"]
        assert f"| {s['kvc_output_tokens_per_s']:,.0f} | {s['ratio']:.3f}x |" in bench
        costs.append(f"{1 - s['ratio']:.1%}")
    assert f"costs {costs[0]} on Benchmark A" in top
    assert f"{min(costs[1:])[:-1]}-{max(costs[1:])} on Benchmark B" in top


def _named_results(text: str) -> set[str]:
    """The result files a README names in full (``results/NAME`` with ``{a,b}`` alternatives
    expanded; ``..._`` abbreviations are skipped)."""
    names = set()
    for ref in re.findall(r"results/([\w.{},-]+\.(?:json|png))", text):
        parts = re.split(r"\{([^}]*)\}", ref)
        choices = [p.split(",") if i % 2 else [p] for i, p in enumerate(parts)]
        names.update("".join(c) for c in itertools.product(*choices))
    return names


def test_named_result_files_exist_and_no_name_carries_a_commit() -> None:
    named = set()
    for readme in (ROOT / "README.md", BENCH_README):
        named |= _named_results(readme.read_text())
    assert len(named) > 30
    missing = sorted(n for n in named if not (RESULTS / n).exists())
    assert not missing, missing
    hashed = [p.name for p in RESULTS.iterdir() if re.search(r"(^|_)[0-9a-f]{7,40}(_|\.)", p.name)]
    assert not hashed, hashed


def test_mixture_of_experts_table_quotes_its_files() -> None:
    bench = _flat(BENCH_README.read_text())
    for shape, label in (("1024-128", "1024 in / 128 out"), ("128-1024", "128 in / 1024 out")):
        d = _load(f"gpu_bench-b-qwen3-30b-a3b-{shape}_NVIDIA_H100_80GB_HBM3.json")
        phases = d["details"]["phases"]
        row = (
            f"| {label} | {d['output_tokens_per_s']:,.0f} | {d['roofline_fraction']:.1%} "
            f"| {phases['decode']['fraction']:.1%} | {phases['prefill']['fraction']:.1%} |"
        )
        assert row in bench, row


def test_fp8_kv_tables_quote_their_files() -> None:
    """The fp8 KV cache's quality table (CPU) and speed table (H100), in the benchmarks
    README, are their files' numbers; the top README quotes the loss and the speed-ups."""
    bench = _flat(BENCH_README.read_text())
    top = _flat((ROOT / "README.md").read_text())
    q = _load("fp8_kv_quality_cpu.json")
    for m in q["models"]:
        for name, v in m["methods"].items():
            if name == "auto":
                row = f"| {m['model']} | auto | {v['mean_nll']:.4f} | - | - | - |"
            else:
                loss, agree = v["loss_vs_auto"], v["agreement"]
                lo, hi = loss["ci95"]
                row = (
                    f"| {m['model']} | {name} | {v['mean_nll']:.4f} | {loss['relative']:+.2%} "
                    f"[{lo:+.2%}, {hi:+.2%}] | {agree['exact_outputs']:.0%} "
                    f"| {agree['prefix_fraction']:.0%} |"
                )
            assert row in bench, row
        fp8 = m["methods"]["fp8"]["loss_vs_auto"]["relative"]
        assert f"{fp8:.2%}" in top
    b = _load("fp8_kv_bench-b_NVIDIA_H100_80GB_HBM3.json")
    labels = {"in1024_out128": "1024 in / 128 out", "in128_out1024": "128 in / 1024 out"}
    for key, label in labels.items():
        r = b[key]
        most, roof = r["max_decode_batch"], r["roofline_fraction"]
        row = (
            f"| {label} | {r['bf16_output_tokens_per_s']:,.0f} "
            f"| {r['fp8_output_tokens_per_s']:,.0f} | {r['fp8_over_bf16']:.2f}x "
            f"| {most['bf16']} / {most['fp8']} | {roof['bf16']:.1%} / {roof['fp8']:.1%} "
            f"| {r['hf_generate']['output_tokens_per_s']:,.0f} |"
        )
        assert row in bench, row
        assert f"{r['fp8_over_bf16']:.2f}x" in top


def test_fp8_kv_compress_quality_table_quotes_its_files() -> None:
    """The fp8 + KV-Compress quality rows (benchmarks README) are their files' numbers: each
    file's KV-Compress run against its fp8 variant, at every rate both ran."""
    bench = _flat(BENCH_README.read_text())
    names = re.findall(r"(kvcompress_quality_fp8\w*_cpu\.json)", bench)
    assert len(set(names)) == 4
    for name in set(names):
        d = _load(name)
        s, comp = d["summary"]["methods"], d["comparison_vs_kvcompress"]
        variant = next(k for k in s if k.startswith("kvcompress+"))
        for length, r in itertools.product(d["lengths"], set(s["kvcompress"]) & set(s[variant])):
            a, b, c = s["kvcompress"][r], s[variant][r], comp[variant][r]
            lo, hi = c["ci"]
            row = (
                f"| {d['model']} | {variant.split('+', 1)[1].replace('+', ', ')} | {length:,} "
                f"| {float(r):g}x | {a['avg']['mean']:.1%} [{a['avg']['ci'][0]:.1%}, "
                f"{a['avg']['ci'][1]:.1%}] | {b['avg']['mean']:.1%} [{b['avg']['ci'][0]:.1%}, "
                f"{b['avg']['ci'][1]:.1%}] | {-c['avg_diff'] * 100 + 0.0:+.1f} "
                f"[{-hi * 100 + 0.0:+.1f}, {-lo * 100 + 0.0:+.1f}] "
                f"| {a['nll']['mean']:.4f} / {b['nll']['mean']:.4f} |"
            )
            assert row in bench, row


def test_gemma3_quality_table_quotes_its_file() -> None:
    """The Gemma-3-270M quality rows (benchmarks README) are its file's numbers: each method's
    average score and interval at every rate, and its loss; the full cache's too."""
    bench = BENCH_README.read_text()
    d = _load("kvcompress_quality_gemma3_cpu.json")
    s = (d["summary_peer_tasks"] or d["summary"])["methods"]
    rates = [str(r) for r in d["rates"]]
    full = s["full"]["1"]
    flat = _flat(bench)
    assert f"Full cache {full['avg']['mean']:.2f} [{full['avg']['ci'][0]:.2f}, " in flat
    assert f"loss {full['nll']['mean']:.3f}" in flat
    labels = {"kvcompress": "KV-Compress", "uniform": "uniform per head", "random": "random",
              "snapkv": "kvpress SnapKV", "adakv_snapkv": "kvpress AdaKV(SnapKV)",
              "adakv_expected_attention": "kvpress AdaKV(Expected Attention)",
              "keydiff": "kvpress KeyDiff"}  # fmt: skip
    section = bench[bench.index("**Gemma-3-270M**") :]
    for key, label in ((k, v) for k, v in labels.items() if k in s):
        cells = [
            f"{s[key][r]['avg']['mean']:.2f} [{s[key][r]['avg']['ci'][0]:.2f}, "
            f"{s[key][r]['avg']['ci'][1]:.2f}]"
            for r in rates
        ]
        loss = " / ".join(f"{s[key][r]['nll']['mean']:.3f}" for r in rates)
        assert _row(section, label) == f"| {label} | " + " | ".join(cells) + f" | {loss} |"


def test_smollm2_gpu_quality_table_quotes_its_file() -> None:
    """The SmolLM2 GPU quality rows (benchmarks README) are its file's numbers: each method's
    average score and interval at every rate and its losses; the full cache's too."""
    bench = BENCH_README.read_text()
    d = _load("kvcompress_quality_smollm2_NVIDIA_H100_80GB_HBM3.json")
    s = d["summary"]["methods"]
    rates = [str(r) for r in d["rates"]]
    flat = _flat(bench)
    full = s["full"]["1"]
    assert (
        f"The full cache's average is {full['avg']['mean']:.3f} [{full['avg']['ci'][0]:.2f}, "
        in flat
    )
    assert f"Loss (full cache {full['nll']['mean']:.3f})" in flat
    labels = {"kvcompress": "KV-Compress", "uniform": "uniform per head",
              "kvcompress+kvc_head_floor=0.5": "KV-Compress, head floor 0.5",
              "kvcompress+kvc_head_floor=0.8": "KV-Compress, head floor 0.8"}  # fmt: skip
    section = bench[bench.index("SmolLM2-135M-Instruct, bfloat16, one H100") :]
    for key, label in labels.items():
        cells = [
            f"{s[key][r]['avg']['mean']:.3f} [{s[key][r]['avg']['ci'][0]:.2f}, "
            f"{s[key][r]['avg']['ci'][1]:.2f}]"
            for r in rates
        ]
        assert _row(section, label) == f"| {label} | " + " | ".join(cells) + " |"
        assert ", ".join(f"{s[key][r]['nll']['mean']:.3f}" for r in rates) in flat
    kvc8 = s["kvcompress"]["8"]["avg"]["mean"] / full["avg"]["mean"]
    assert f"KV-Compress keeps {kvc8:.0%} of the full cache's average at 8x" in flat


def test_fp8_micro_table_quotes_its_file() -> None:
    """The fp8 decode kernel's table (H100) is its file's rows: every row it shows, and at
    least the defaults' launch shape (4 warps, 2 stages) for bf16 at 64-key tiles and fp8 at
    64 and 128; and its file has the fp8 default (128 keys, 4 warps, 2 stages) beating 64-key
    tiles and within 1% of the fastest shape swept, as the README says."""
    text = BENCH_README.read_text()
    bench = _flat(text)
    rows = [r for r in _load("fp8_attn_micro_NVIDIA_H100_80GB_HBM3.json")["rows"]
            if not r.get("v_late")]  # fmt: skip

    def line(r: dict) -> str:
        return (
            f"| {r['batch']} | {r['cache']} | {r['tile_n']} | {r['num_warps']} / "
            f"{r['num_stages']} | {r['us']:.0f} | {r['fraction_of_copy_bw']:.1%} |"
        )

    quoted = re.findall(r"^\| \d+ \| (?:bf16|fp8) \| \d+ \| \d+ / \d+ \|.*\|$", text, re.M)
    assert quoted and set(quoted) <= {line(r) for r in rows}, set(quoted) - {line(r) for r in rows}
    defaults = [r for r in rows if (r["num_warps"], r["num_stages"]) == (4, 2)]
    for r in defaults:
        if r["cache"] == "fp8" or r["tile_n"] == 64:
            assert line(r) in bench, line(r)
    fp8 = {(r["batch"], r["tile_n"]): r["us"] for r in defaults if r["cache"] == "fp8"}
    assert all(fp8[b, 128] < fp8[b, 64] for b, _ in fp8)
    for b, _ in fp8:
        fastest = min(r["us"] for r in rows if r["cache"] == "fp8" and r["batch"] == b)
        assert fp8[b, 128] <= 1.01 * fastest


def test_kernel_and_server_tables_quote_their_files() -> None:
    """The per-kernel table (H100, H200) is its six files' by_kind rows (ms a step and fraction of
    the limit) and device ms a step; the server's H100 table is its file's TTFT p50 / p99 and
    throughput ratios, and the four API servers' TTFT p50 beats the one's, as the text says."""
    text = BENCH_README.read_text()
    names = ("a", "b_in128_out1024", "b_in1024_out128")
    profiles = [_load(f"kernel_table_bench-{n}_{dev}.json")["kernel_profile"]
                for n in names for dev in ("NVIDIA_H100_80GB_HBM3", "NVIDIA_H200")]  # fmt: skip
    for kind in ("attention", "gemm", "rms_norm", "rope", "act_and_mul", "sampling", "other"):
        cells = []
        for kp in profiles:
            row = next(r for r in kp["by_kind"] if r["kind"] == kind)
            cell = f"{row['ms_per_step']:.3f}"
            if "fraction_of_limit" in row:
                cell += f" ({row['fraction_of_limit']:.2f})"
            cells.append(cell)
        assert _row(text, f"{kind} |") == f"| {kind} | " + " | ".join(cells) + " |"
    device = " | ".join(f"{kp['device_ms_per_step']:.3f}" for kp in profiles)
    assert _row(text, "device ms a step") == f"| device ms a step | {device} |"

    d = _load("serving_gpu_qwen3-0.6b_NVIDIA_H100_80GB_HBM3.json")
    runs, before = d["runs"], d["baseline_runs"]  # the same call: now, and the tree before
    for c in ("64", "256"):
        off = runs["offline"][c]
        cells = [f"{off['ttft_ms']['p50']:.1f} / {off['ttft_ms']['p99']:.1f}, "
                 f"{off['output_throughput']:,.0f}"]  # fmt: skip
        for mode in ("server_process", "server_api4"):
            for r in (before[mode][c], runs[mode][c]):
                t, ratio = r["ttft_ms"], r["output_throughput"] / off["output_throughput"]
                cells.append(f"{t['p50']:.1f} / {t['p99']:.1f}, {ratio:.3f}x")
        assert _row(text, f"{c} | {off['ttft_ms']['p50']:.1f}") == f"| {c} | " + " | ".join(
            cells) + " |"  # fmt: skip
        ttft = {m: runs[m][c]["ttft_ms"]["p50"] for m in ("server_process", "server_api4")}
        assert ttft["server_api4"] < ttft["server_process"]
        for mode in ("server_process", "server_api4"):  # the hot path's cut, as the text says
            assert runs[mode][c]["ttft_ms"]["p50"] < before[mode][c]["ttft_ms"]["p50"]
    rep = d["repeat_call"]["runs"]  # the later call's ratios, as the text gives them

    def ratio(mode: str, c: str, q: str) -> str:
        return f"{rep[mode][c]['ttft_ms'][q] / rep['offline'][c]['ttft_ms'][q]:.2f}x"

    line = (
        f"at {ratio('server_api4', '64', 'p50')} (64) and {ratio('server_api4', '256', 'p50')}"
        f" (256) the engine's TTFT p50, p99 {ratio('server_api4', '64', 'p99')} and "
        f"{ratio('server_api4', '256', 'p99')}; one API server at "
        f"{ratio('server_process', '64', 'p50')} and {ratio('server_process', '256', 'p50')}."
    )
    assert line in _flat(text)
    # the README's line on --api-server-count quotes the same file
    readme = _flat((ROOT / "README.md").read_text())
    assert f"from {ttft['server_process']:.1f} to {ttft['server_api4']:.1f} ms p50" in readme
