"""The built-in KV connectors' own configs, from the engine's (``core/sched/connector.py``
loads the roles; this module knows which config each built-in one takes)."""

from __future__ import annotations

from typing import Any

from pagedllm.core.kv_transfer.scheduler import kv_transfer_role_config
from pagedllm.core.sched.offload import offload_config


def role_configs(kvc_config: Any, cache_config: Any, kv_groups: Any) -> dict[str, Any]:
    """Each built-in role's own config (None where a role is off)."""
    keep = keep_last(kv_groups, kvc_config)
    return {
        "kvcompress": kvc_config,
        "offload": offload_config(cache_config, kv_groups, keep),
        "kv_transfer": kv_transfer_role_config(cache_config.kv_transfer, kv_groups, keep),
    }


def keep_last(kv_groups: Any, kvc_config: Any) -> int:
    """Prompt tokens an engine computes itself when a role (the host tier, a KV transfer)
    brings the rest: the last one, for its logits; with KV-Compress's per-head cache its
    observation window, whose queries score the keys the first eviction keeps."""
    if kv_groups is None or kv_groups.head_paged is None or kvc_config is None:
        return 1
    return max(1, kvc_config.prefill_metric_collection_window_size)
