"""The built-in KV connectors' own configs, from the engine's (``core/sched/connector.py``
loads the roles; this module knows which config each built-in one takes)."""

from __future__ import annotations

from typing import Any

from pagedllm.core.kv_transfer.scheduler import kv_transfer_role_config
from pagedllm.core.sched.offload import offload_config


def role_configs(kvc_config: Any, cache_config: Any, kv_groups: Any) -> dict[str, Any]:
    """Each built-in role's own config (None where a role is off)."""
    return {
        "kvcompress": kvc_config,
        "offload": offload_config(cache_config, kv_groups, kvc_config),
        "kv_transfer": kv_transfer_role_config(cache_config.kv_transfer, kv_groups, kvc_config),
    }
