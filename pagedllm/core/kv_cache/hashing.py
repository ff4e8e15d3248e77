"""Chained block hashes for automatic prefix caching."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from pagedllm.core.kv_cache.block import BlockHash

_ROOT = b"pagedllm-root"


def hash_block(
    parent: BlockHash | None, token_ids: Sequence[int], extra: str | None = None
) -> BlockHash:
    """Hash of a full block: sha256(parent digest | token ids | extra such as a cache salt).

    Chaining makes the hash stand for the whole prefix up to and including this block, so two
    requests share block i only if they agree on every token before it.
    """
    h = hashlib.sha256(parent.digest if parent is not None else _ROOT)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    if extra:
        h.update(extra.encode())
    return BlockHash(h.digest(), tuple(token_ids))


def block_hash_extra(request: object) -> str | None:
    """What a request's first block hash carries beside its tokens: its ``cache_salt`` and its
    LoRA adapter's key, so that two tenants, or two adapters (or an adapter and the base
    model), never share KV blocks, while requests with the same salt and adapter do.
    Example: salt "t1", adapter 3 'sql' at /a -> "t1|lora:3:sql:/a"; neither -> None."""
    salt = getattr(request, "cache_salt", None)
    lora = getattr(request, "lora_request", None)
    if lora is None:
        return salt
    return f"{salt or ''}|{lora.cache_key()}"


def hash_request_blocks(
    token_ids: Sequence[int],
    block_size: int,
    existing: list[BlockHash],
    extra: str | None = None,
) -> list[BlockHash]:
    """Extend ``existing`` (hashes of the first full blocks) to cover every full block of
    ``token_ids``. Only the new blocks are hashed, so this is O(new blocks) per step.

    Example: block_size 4, 10 tokens, existing [] -> hashes of tokens[0:4] and tokens[4:8];
    tokens[8:10] are a partial block and are not hashed.
    """
    num_full = len(token_ids) // block_size
    for i in range(len(existing), num_full):
        parent = existing[i - 1] if i > 0 else None
        # The salt enters the first block only: the chain carries it to every later block.
        existing.append(
            hash_block(
                parent, token_ids[i * block_size : (i + 1) * block_size], extra if i == 0 else None
            )
        )
    return existing
