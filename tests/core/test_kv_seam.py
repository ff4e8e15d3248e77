"""The KV seam holds in the code: the scheduler asks its KV manager only what the manager
protocol declares, the KV-Compress planner asks the per-head manager only what its own
protocol declares, and the scheduler and the model runner name KV-Compress only at their hooks
(read from the source; nothing is run)."""

from __future__ import annotations

import re
from pathlib import Path

from pagedllm.core.kv_cache.head_paged import HeadPagedKVCacheManager
from pagedllm.core.kv_cache.interface import KVCacheManagerBase, PerHeadKVManager

ROOT = Path(__file__).resolve().parents[2] / "pagedllm"


def _attrs(path: str, receivers: str) -> set[str]:
    return set(re.findall(rf"(?:{receivers})\.(\w+)", (ROOT / path).read_text()))


def _declared(cls: type) -> set[str]:
    names = set(getattr(cls, "__annotations__", {}))
    for base in cls.__mro__:
        names |= set(vars(base)) | set(getattr(base, "__annotations__", {}))
    return names


def test_the_scheduler_asks_only_what_the_manager_protocol_declares():
    used = _attrs("core/sched/scheduler.py", r"self\.kv_cache_manager|\bkvm?")
    assert used and used <= _declared(KVCacheManagerBase), used - _declared(KVCacheManagerBase)


def test_the_planner_asks_only_what_the_per_head_protocol_declares():
    used = _attrs("core/sched/kvc.py", r"self\.kvm|\bkvm")
    assert used and used <= _declared(PerHeadKVManager), used - _declared(PerHeadKVManager)
    # and the per-head manager has all of it
    assert all(hasattr(HeadPagedKVCacheManager, n) or n in ("compressible", "block_size",
               "num_compressions", "num_evicted_kvs") for n in used)  # fmt: skip


def test_the_hot_files_name_kv_compress_only_at_their_hooks():
    for path in ("core/sched/scheduler.py", "worker/model_runner.py"):
        lines = (ROOT / path).read_text().splitlines()
        named = [ln for ln in lines if re.search(r"kvc(?!ache)|compress", ln, re.I)]
        assert len(named) <= 10, (path, named)
        assert len(lines) <= 850, (path, len(lines))
