"""``--kv-transfer-config``: prefill/decode disaggregation (vLLM's flag and JSON shape).

    pagedllm serve MODEL --port 8100 --kv-transfer-config '{"kv_role": "kv_producer"}'
    pagedllm serve MODEL --port 8200 --kv-transfer-config '{"kv_role": "kv_consumer"}'
    pagedllm proxy --prefill http://localhost:8100 --decode http://localhost:8200 --port 8000

Keys: ``kv_role`` (``kv_producer``: computes prompts and hands their KV over; ``kv_consumer``:
continues requests from a producer's KV; ``kv_both``: either, per request), ``kv_connector``
(the transport; ``SharedMemoryConnector``, the only one so far: engines of one host),
``engine_id`` (names this engine's transfers; default: random), ``kv_buffer_path`` (a
directory both engines see; default ``/dev/shm/pagedllm-kv``, else the temporary directory),
``kv_buffer_size`` (bytes of a producer's buffer, vLLM's key: on a GPU, device memory the
consumers read by CUDA IPC; on a CPU, a shared-memory mapping; default 1e9 on a GPU producer,
0 elsewhere), ``kv_transfer_timeout`` (seconds a producer keeps a transfer nobody took;
default 120).

Where a transfer's rows go: into a free range of the producer's buffer when one is large
enough (``core/kv_transfer/arena.py``; the consumer copies them device to device), else into
the transfer's file in ``kv_buffer_path`` (through host memory). Either way the file holds
the header and which rows hold KV, and its name is what the proxy passes on.
"""

from __future__ import annotations

import json
import os
import tempfile
import uuid
from dataclasses import dataclass, fields, replace
from typing import Any

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_TRANSPORTS = ("SharedMemoryConnector",)


def default_buffer_path() -> str:
    """Shared memory where the host has it (RAM, not disk), else the temporary directory."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, "pagedllm-kv")


@dataclass(frozen=True)
class KVTransferConfig:
    """A validated ``--kv-transfer-config`` (see the module docstring); ``tp_size`` is the
    engine's tensor-parallel size (each rank hands over its own shard of the heads)."""

    kv_role: str
    kv_connector: str = "SharedMemoryConnector"
    engine_id: str = ""
    kv_buffer_path: str = ""
    kv_transfer_timeout: float = 120.0
    kv_buffer_size: float | None = None  # bytes (None: by device, ``with_device``)
    tp_size: int = 1

    def __post_init__(self) -> None:
        if self.kv_role not in KV_ROLES:
            raise ValueError(
                f"kv_transfer_config.kv_role must be one of {KV_ROLES}, got {self.kv_role!r}."
            )
        if self.kv_connector not in KV_TRANSPORTS:
            raise ValueError(
                f"kv_transfer_config.kv_connector {self.kv_connector!r} is not available; "
                f"pagedllm has {KV_TRANSPORTS} (engines of one host)."
            )
        t = self.kv_transfer_timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0:
            raise ValueError(
                f"kv_transfer_config.kv_transfer_timeout must be positive seconds, got {t!r}."
            )
        size = self.kv_buffer_size
        if size is not None and (
            isinstance(size, bool) or not isinstance(size, (int, float)) or not size >= 0
        ):
            raise ValueError(
                f"kv_transfer_config.kv_buffer_size must be a byte count >= 0, got {size!r}."
            )
        if not isinstance(self.engine_id, str) or not _safe(self.engine_id):
            raise ValueError(
                "kv_transfer_config.engine_id may hold letters, digits, '.', '_' and '-' only, "
                f"got {self.engine_id!r}."
            )

    def with_device(self, device: str) -> KVTransferConfig:
        """``kv_buffer_size`` resolved for the engine's device: 1e9 bytes on a GPU producer
        (vLLM's default), else 0 (files only) where it was not given."""
        if self.kv_buffer_size is not None:
            return self
        size = 1e9 if device == "cuda" and self.is_producer else 0
        return replace(self, kv_buffer_size=size)

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def parse(cls, value: Any, tp_size: int = 1) -> KVTransferConfig | None:
        """From a dict, its JSON text, or a config (None: off). Unknown keys are an error
        naming them; vLLM's keys this transport has no use for (``kv_rank``,
        ``kv_parallel_size``, ``kv_ip``, ``kv_port``, ``kv_connector_extra_config``,
        ``kv_buffer_device``) are accepted and ignored."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"kv_transfer_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(
                f"kv_transfer_config must be a dict or its JSON text, got {type(value).__name__}."
            )
        known = {f.name for f in fields(cls)} - {"tp_size"}
        ignored = {
            "kv_rank",
            "kv_parallel_size",
            "kv_ip",
            "kv_port",
            "kv_connector_extra_config",
            "kv_buffer_device",
        }
        unknown = sorted(set(value) - known - ignored)
        if unknown:
            raise ValueError(
                f"kv_transfer_config has unknown keys {unknown}; known: {sorted(known)}."
            )
        if "kv_role" not in value:
            raise ValueError(f"kv_transfer_config needs kv_role, one of {KV_ROLES}.")
        kw = {k: v for k, v in value.items() if k in known}
        kw.setdefault("engine_id", uuid.uuid4().hex[:12])
        kw["kv_buffer_path"] = kw.get("kv_buffer_path") or default_buffer_path()
        return cls(**kw, tp_size=tp_size)


def _safe(name: str) -> bool:
    """Whether ``name`` can be part of a file name as it is (no path, nothing odd)."""
    return all(c.isalnum() or c in "._-" for c in name) and not name.startswith(".")
