"""PNG of the scale-out results (scale_out_bench-b_{tp,dp}_*.json): Benchmark B output tokens/s
by tensor- or data-parallel size, with the per-GPU roofline x TP (TP runs) and the runs with the
all-reduce skipped.
Usage: python benchmarks/plot_scale_out.py RESULT.json [MORE.json ...] -o OUT.png"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("-o", "--out", required=True)
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs: dict = {}
    device = ""
    for f in args.files:
        with open(f) as fh:
            d = json.load(fh)
        device = d.get("device", device)
        for key, r in d["runs"].items():
            if "output_tokens_per_s" in r:
                runs.setdefault(key, []).append((f, r))
    shapes = sorted({k.split("_")[0] for k in runs})
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.5), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        labels, vals, roofs = [], [], []
        for key in sorted(k for k in runs if k.startswith(shape + "_")):
            for i, (_, r) in enumerate(runs[key]):
                tag = key.split("_", 1)[1].replace("_no_allreduce", "\nno all-reduce")
                labels.append(tag + (f"\n(call {i + 1})" if len(runs[key]) > 1 else ""))
                vals.append(r["output_tokens_per_s"])
                roofs.append(r.get("roofline_per_gpu_output_tokens_per_s", float("nan")))
        x = range(len(vals))
        ax.bar(x, vals, label="measured")
        if any(r == r for r in roofs):  # NaN for runs without one (DP)
            ax.plot(x, roofs, "k_", markersize=30, mew=2, label="roofline (per GPU, x TP)")
        for i, v in zip(x, vals):
            ax.text(i, v, f"{v:,.0f}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(x), labels, fontsize=8)
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"Benchmark B {shape.replace('x', ' -> ')}, Llama-3.1-8B shape")
        ax.legend(fontsize=8)
    fig.suptitle(f"pagedllm scale-out, {device}")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
