"""Plot the GPU benchmark results (benchmarks/results/gpu_bench-*.json) as one PNG each:
output tokens/s of pagedllm's variants, the HF peers measured in the same call, and the
bandwidth roofline. Usage: python benchmarks/plot_gpu.py [results_dir]"""

from __future__ import annotations

import glob
import json
import os
import sys


def bars_a(d: dict) -> list[tuple[str, float]]:
    out = []
    for key, label in (
        ("pagedllm_cuda_graphs", "pagedllm\n(graphs, async)"),
        ("pagedllm_cuda_graphs_sync", "pagedllm\n(graphs, sync)"),
        ("pagedllm_eager", "pagedllm\n(eager)"),
        ("hf_continuous_batching", "HF generate_batch"),
        ("hf_static_generate", "HF generate"),
    ):
        if "output_tokens_per_s" in d.get(key, {}):
            out.append((label, d[key]["output_tokens_per_s"]))
    out.append(("roofline", d["roofline_output_tokens_per_s"]))
    return out


def bars_b(part: dict) -> list[tuple[str, float]]:
    out = [("pagedllm", part["output_tokens_per_s"])]
    for key, label in (("hf_continuous_batching", "HF generate_batch"),
                       ("hf_static_generate", "HF generate")):
        if "output_tokens_per_s" in part.get(key, {}):
            out.append((f"{label}\n({part[key].get('num_prompts')} prompts)",
                        part[key]["output_tokens_per_s"]))
    out.append(("roofline", part["roofline_output_tokens_per_s"]))
    return out


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    root = sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results"
    for path in sorted(glob.glob(os.path.join(root, "gpu_bench-*.json"))):
        if path.endswith(".partial.json"):
            continue
        d = json.load(open(path))
        if "pagedllm_cuda_graphs" in d:
            panels = [(d.get("benchmark", "A"), bars_a(d))]
        elif "details" in d:  # one Benchmark B workload
            panels = [(d["benchmark"], bars_b(d["details"]))]
        else:
            panels = [(f"{d.get('benchmark', 'B')} {k}", bars_b(v)) for k, v in d.items()
                      if isinstance(v, dict) and "roofline_output_tokens_per_s" in v]
        fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
        for ax, (title, bars) in zip(axes[0], panels):
            labels, values = zip(*bars)
            colors = ["tab:blue" if lb.startswith("pagedllm") else
                      "lightgray" if lb == "roofline" else "tab:orange" for lb in labels]
            ax.bar(range(len(values)), values, color=colors)
            ax.set_xticks(range(len(values)), labels, fontsize=7)
            ax.set_ylabel("output tokens/s")
            ax.set_title(f"{title} on {d.get('device')}", fontsize=9)
            for i, v in enumerate(values):
                ax.text(i, v, f"{v:,.0f}", ha="center", va="bottom", fontsize=7)
        fig.tight_layout()
        out = path[:-5] + ".png"
        fig.savefig(out, dpi=120)
        print("wrote", out)


if __name__ == "__main__":
    main()
