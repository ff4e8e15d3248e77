"""PNG of a speculative decoding result (spec_decode_{qwen3,cheap,llama8b}_*.json): output
tokens/s against the measured acceptance rate, one panel per batch size - draft-model sweeps
(k = 2 and 4) as lines, other proposers (n-gram, suffix, first-layers drafts: the ``cheap``
part) as points - with the run without speculation (same process) as a dashed line.
Usage: python benchmarks/plot_spec_decode.py RESULT.json -o OUT.png"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("-o", "--out", required=True)
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(args.file) as f:
        d = json.load(f)
    base = d["baseline"]
    batches = sorted(int(b) for b in base)
    fig, axes = plt.subplots(1, len(batches), figsize=(4 * len(batches), 3.8), squeeze=False)
    for ax, b in zip(axes[0], batches):
        sweep = d.get("draft_model", [])
        for k in sorted({r["k"] for r in sweep}):
            rows = [r for r in sweep if r["batch"] == b and r["k"] == k
                    and "disable_by_batch_size" not in r and r.get("acceptance_rate") is not None]
            rows.sort(key=lambda r: r["acceptance_rate"])
            ax.plot([r["acceptance_rate"] for r in rows],
                    [r["output_tokens_per_s"] for r in rows], "o-", label=f"draft, k={k}")
        ax.axhline(base[str(b)]["output_tokens_per_s"], color="k", ls="--", label="no speculation")
        for r in d.get("proposers", []):
            if r["batch"] == b:
                ax.plot([r["acceptance_rate"]], [r["output_tokens_per_s"]], "s",
                        label=f"{r['proposer']}, k={r['k']}")
        for r in sweep:
            if r["batch"] == b and "disable_by_batch_size" in r:
                ax.axhline(r["output_tokens_per_s"], color="r", ls=":",
                           label=f"paused (disable_by_batch_size={r['disable_by_batch_size']})")
        ax.set_title(f"batch {b}")
        ax.set_xlabel("acceptance rate")
        ax.set_ylabel("output tokens/s")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    fig.suptitle(f"pagedllm speculative decoding, {d['workload']['model']}, {d['device']}")
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)


if __name__ == "__main__":
    main()
