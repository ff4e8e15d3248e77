"""The engine's state as plain data, for the dashboard (``pagedllm/dashboard``) and the bench
report: the device block pool as a map, the host tiers, every request's place and tokens, and
with KV-Compress the KVs each (layer, KV head) holds.

``engine_snapshot(core)`` runs in the engine core between two steps (the server asks for it
with ``call_in_core``, a few times a second at most and only while someone watches); it reads
the scheduler and the KV manager and changes nothing. Its cost is in the result
(``build_ms``) and in ``benchmarks/dashboard_cost.py``.

The result (JSON-able; documented for scripts in ``docs/DASHBOARD.md``):
    time, num_steps, step_seconds       wall clock (s since the epoch), the core's counters
    stats                               ``EngineCore.stats()``
    blocks   {total, block_size, per_head, counts{free, cached, used, shared, reserved},
              blocks_per_cell, cells [state code per cell], cell_owner [index in owners or
              -1], owners [request ids]}
    host     [{name, total, used, busy}]: the swap space, the host prefix tier
    requests [{id, status, prompt_tokens, output_tokens, computed_tokens, cached_tokens,
              blocks, priority, age_s, preemptions, kvc, held_kvs, lora}] (running first)
    heads    null without KV-Compress; else {layers, kv_heads, compressible [layers],
              kept [layers][kv_heads] (KVs held over tokens, all requests), requests [{id,
              num_tokens, lens [layers][kv_heads]}] (the largest first)}
    build_ms                            what building it took
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from pagedllm.core.kv_cache.block_map import build_block_map, downsample
from pagedllm.core.request import RequestStatus

DEFAULT_CELLS = 4096  # the map's resolution: a bigger pool shows k blocks per cell
MAX_REQUESTS = 256  # rows of the request table
MAX_HEAD_REQUESTS = 8  # requests whose per-head lengths are sent

_STATUS = {
    RequestStatus.WAITING: "waiting",
    RequestStatus.WAITING_FOR_GRAMMAR: "grammar",
    RequestStatus.RUNNING: "running",
    RequestStatus.PREEMPTED: "preempted",
}


def engine_snapshot(core: Any, max_cells: int = DEFAULT_CELLS) -> dict[str, Any]:
    """The snapshot of ``core`` (an ``EngineCore``) described in the module docstring."""
    t0 = time.perf_counter()
    sched = core.scheduler
    kv = sched.kv_cache_manager
    bmap = kv.block_map()
    k, cells, cell_owner = downsample(bmap, max_cells)
    held = dict(zip(bmap.request_ids, bmap.request_blocks.tolist(), strict=True))
    per_head = hasattr(kv, "head_lens")
    out: dict[str, Any] = {
        "time": time.time(),
        "num_steps": core.num_steps,
        "step_seconds": core.step_seconds,
        "stats": core.stats(),
        "blocks": {
            "total": bmap.num_blocks,
            "block_size": kv.block_size,
            "per_head": per_head,
            "counts": bmap.counts(),
            "blocks_per_cell": k * bmap.stride,
            "sampled_every": bmap.stride,
            "cells": cells.tolist(),
            "cell_owner": cell_owner.tolist(),
            "owners": list(bmap.request_ids),
        },
        "host": _host_tiers(kv, sched),
        "requests": _requests(sched, kv, held, per_head, core.config.kvc_config),
        "heads": _heads(kv, sched, core.config.kvc_config) if per_head else None,
    }
    out["build_ms"] = (time.perf_counter() - t0) * 1e3
    return out


def _budget(r: Any, kvc: Any) -> str | None:
    """A request's KV-Compress budget as the table shows it ("256 tokens", "4x"), its own or
    the server's default; None without one."""
    sp = r.sampling_params
    for tokens, rate, whose in (
        (sp.max_cache_tokens, sp.compression_rate, ""),
        (kvc.max_cache_tokens, kvc.compression_rate, " (default)"),
    ):
        if tokens is not None:
            return f"{tokens} tokens{whose}"
        if rate is not None:
            return f"{rate:g}x{whose}"
    return None


def _requests(sched: Any, kv: Any, held: dict[str, int], per_head: bool, kvc: Any) -> list[dict]:
    """The request table: running (in their batch order), then waiting and preempted (in
    their queue order), at most ``MAX_REQUESTS``."""
    now = time.monotonic()
    order = list(sched.running) + [r for r in sched.waiting]
    seen = {r.request_id for r in order}
    order += [r for r in sched.requests.values() if r.request_id not in seen]
    rows = []
    for r in order[:MAX_REQUESTS]:
        status = _STATUS.get(r.status, r.status.name.lower())
        if r.status == RequestStatus.PREEMPTED and r.swapped:
            status = "swapped"
        rows.append({
            "id": r.request_id,
            "status": status,
            "prompt_tokens": r.num_prompt_tokens,
            "output_tokens": len(r.output_token_ids),
            "computed_tokens": r.num_computed_tokens,
            "cached_tokens": max(r.num_cached_tokens, 0),
            "blocks": held.get(r.request_id, 0),
            "priority": r.priority,
            "age_s": round(now - r.arrival_time, 3),
            "preemptions": r.num_preemptions,
            "kvc": _budget(r, kvc) if per_head else None,
            "held_kvs": kv.held_kvs(r.request_id) if per_head else None,
            "lora": r.lora_request.lora_name if r.lora_request is not None else None,
        })  # fmt: skip
    return rows


def _heads(kv: Any, sched: Any, kvc: Any) -> dict[str, Any]:
    """Per (layer, KV head), over the requests with a KV-Compress budget: the KVs they hold
    over the tokens they have (1.0: nothing evicted), and the lengths of the
    ``MAX_HEAD_REQUESTS`` of them with the most tokens."""
    layers = kv.spec.num_layers
    lens = {}
    for rid in list(kv.states):
        r = sched.requests.get(rid)
        h = kv.head_lens(rid)
        if h is not None and r is not None and _budget(r, kvc) is not None:
            lens[rid] = h
    kv_heads = kv.num_heads // max(1, layers)
    kept = np.zeros((layers, kv_heads))
    tokens = 0
    sizes = {}
    for rid, h in lens.items():
        n = max(sched.requests[rid].num_computed_tokens, int(h.max()))
        sizes[rid] = n
        kept += h
        tokens += n
    top = sorted(sizes, key=lambda rid: -sizes[rid])[:MAX_HEAD_REQUESTS]
    return {
        "layers": layers,
        "kv_heads": kv_heads,
        "compressible": kv.compressible.reshape(layers, -1)[:, 0].tolist(),
        "kept": np.round(kept / max(tokens, 1), 4).tolist() if tokens else None,
        "requests": [{"id": rid, "num_tokens": sizes[rid], "lens": lens[rid].tolist()}
                     for rid in top],
    }  # fmt: skip


def _host_tiers(kv: Any, sched: Any) -> list[dict[str, Any]]:
    """The host memory that holds KV: the swap space (preemption by swap) and the prefix
    cache's host tier (``kv_offloading_size``), each as blocks total / holding KV / in
    flight, with a map of its blocks."""
    tiers = []
    swap = getattr(kv, "swap_space", None)
    total = swap.num_blocks if swap is not None else 0
    if total:
        tiers.append({"name": "swap", "total": total, "used": total - swap.num_free_blocks(),
                      "busy": 0})  # fmt: skip
    host_pool = getattr(kv, "host_pool", None)  # the per-head manager's swap space
    if host_pool is not None:
        tiers.append({"name": "swap", "total": host_pool.num_blocks,
                      "used": host_pool.num_blocks - host_pool.num_free, "busy": 0})  # fmt: skip
    for c in getattr(sched, "connectors", ()):
        if getattr(c, "name", None) == "offload":
            bmap = build_block_map(c.num_host_blocks, [("in flight", list(c.busy))],
                                   list(c.entries.values()))  # fmt: skip
            k, cells, _ = downsample(bmap, 1024)
            counts = bmap.counts()
            tiers.append({"name": "host prefix tier", "total": c.num_host_blocks,
                          "used": counts["cached"] + counts["used"], "busy": len(c.busy),
                          "blocks_per_cell": k * bmap.stride,
            "sampled_every": bmap.stride, "cells": cells.tolist()})  # fmt: skip
    return tiers
