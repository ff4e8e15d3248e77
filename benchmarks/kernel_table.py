"""Print the per-kernel tables of ``pagedllm bench throughput --kernel-profile`` result files
(``kernel_profile.by_kind``: each kind of kernel's ms a step against the least bytes and FLOPs
it must move and do, at the copy and matmul rates measured in the same call).

    python benchmarks/kernel_table.py benchmarks/results/kernel_table_bench-*.json
"""

from __future__ import annotations

import json
import sys


def table(path: str) -> str:
    r = json.load(open(path))
    kp = r.get("kernel_profile") or {}
    rows = kp.get("by_kind")
    head = (f"{path}: {r.get('model')} on {r.get('device')}, {kp.get('steps')} steps from "
            f"{kp.get('first_step')} ({kp.get('decode_only_steps')} decode-only, "
            f"{kp.get('running_mean', 0):.0f} running), device "
            f"{kp.get('device_ms_per_step', 0):.3f} ms a step, copy "
            f"{kp.get('copy_bandwidth_GBps', 0):.0f} GB/s, matmul "
            f"{kp.get('matmul_TFLOPs', 0):.0f} TFLOP/s")  # fmt: skip
    if not rows:
        return head + "\n  (no per-kernel table: not a GPU run, or KV-Compress)"
    lines = [head, f"  {'kind':20} {'ms/step':>8} {'MB/step':>9} {'GFLOP':>8} {'limit ms':>9} "
                   f"{'fraction':>8}  bound"]  # fmt: skip
    for x in rows:
        if "bytes_per_step" in x:
            lines.append(
                f"  {x['kind']:20} {x['ms_per_step']:8.3f} {x['bytes_per_step'] / 1e6:9.1f} "
                f"{x['flops_per_step'] / 1e9:8.1f} {x['limit_ms_per_step']:9.3f} "
                f"{x['fraction_of_limit']:8.2f}  {x['bound']}"
            )
        else:
            lines.append(f"  {x['kind']:20} {x['ms_per_step']:8.3f}")
    return "\n".join(lines)


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print(table(p))
