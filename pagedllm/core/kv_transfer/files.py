"""The shared-memory transport of prefill/decode disaggregation: one file per request and
tensor-parallel rank, in a directory both engines see (``kv_buffer_path``, ``/dev/shm`` by
default: RAM).

A file (``<engine_id>-<request_id>.kv.r<rank>``):

    offset 0          b"PGKV0001", then the header's length (8 bytes, little endian)
    offset 16         the header, JSON (``TransferHeader``)
    mask_offset       [num_groups, num_blocks] bytes: 1 where the row holds its block's KV
    rows_offset       [num_groups * num_blocks, block_bytes] rows (4 KiB aligned; absent when
                      the header names the producer's buffer, ``arena``: the rows are there,
                      from ``arena_row`` on, ``arena.py``): row
                      g * num_blocks + i holds block i of KV-cache group g, block-major (every
                      layer's K and V pages of that block id, back to back: the host tier's
                      layout, ``worker/offload.py``; KV-Compress's per-head blocks are
                      gathered into the same rows, ``layout_of``)

The producer writes ``<name>.tmp`` and renames it when the prompt's last block is in, so a
consumer sees a whole file or none; the consumer claims it by renaming it to
``<name>.<consumer engine id>`` (atomic: one consumer takes it, and the producer's clean-up of
transfers nobody took leaves it alone), reads the rows it lacks, and deletes it.

Example (block size 16, a 40-token prompt, one group, 1 MiB blocks): 2 full blocks, the
header and a 2-byte mask in the first 4 KiB, rows at 4,096 and 4,096 + 1 MiB; the consumer
with the first block cached reads the second row only and computes tokens 32..39.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

MAGIC = b"PGKV0001"
ALIGN = 4096


def layout_of(kv_groups: Any, tp_size: int) -> str:
    """What both engines must agree on for a row to mean the same KV: the groups, block size,
    each cache tensor's page shape and element size, and the tensor-parallel size.

    KV-Compress's per-head blocks (``kv_groups.head_paged``) are written in the plain
    layout's rows: one group, each layer's ``[2, block_size, kv_heads, head_dim]`` page (the
    worker role gathers a row's heads from their own blocks), so an engine with KV-Compress
    and one without exchange transfers. Example: 2 layers, 4 KV heads of 64, bfloat16, block
    16 -> '[1, 16, [[[16, 4, 64], 2], [[16, 4, 64], 2]], 1]', as the plain engine's."""
    head = kv_groups.head_paged
    if head is not None:
        page = [[head.block_size, head.num_kv_heads, head.head_dim], head.dtype_bytes]
        return json.dumps([1, head.block_size, [page] * head.num_layers, tp_size])
    pages = [[list(s.page_shape), s.dtype_bytes] for s in kv_groups.tensor_specs()]
    return json.dumps([kv_groups.num_groups, kv_groups.block_size, pages, tp_size])


def row_bytes(kv_groups: Any) -> int:
    """Bytes of one row (one block of every layer, K and V, this rank's heads)."""
    head = kv_groups.head_paged
    if head is not None:
        return head.num_layers * head.num_kv_heads * head.page_bytes
    return kv_groups.block_bytes


def transfer_name(engine_id: str, request_id: str) -> str:
    """A request's transfer file name (before the rank suffix); odd characters of the request
    id become '_'. Example: ('a1', 'chatcmpl-7/x') -> 'a1-chatcmpl-7_x.kv'."""
    rid = "".join(c if c.isalnum() or c in "._-" else "_" for c in request_id)
    return f"{engine_id}-{rid}.kv"


def rank_path(directory: str, name: str, rank: int | str) -> str:
    return os.path.join(directory, f"{name}.r{rank}")


def token_digest(token_ids: Any) -> str:
    """A digest of the prompt tokens the rows were computed from (the consumer's prompt must
    start with them)."""
    return hashlib.sha256(np.asarray(token_ids, dtype=np.int64).tobytes()).hexdigest()


@dataclass(frozen=True)
class TransferHeader:
    """What a transfer file holds (see the module docstring)."""

    layout: str
    block_size: int
    block_bytes: int
    num_groups: int
    num_blocks: int
    tokens: str  # token_digest of the first num_blocks * block_size prompt tokens
    arena: str = ""  # the producer's buffer holding the rows ("": this file holds them)
    arena_row: int = -1  # the buffer row of row 0

    def encode(self) -> bytes:
        text = json.dumps(asdict(self)).encode()
        return MAGIC + struct.pack("<Q", len(text)) + text

    @property
    def num_rows(self) -> int:
        return self.num_groups * self.num_blocks

    def mask_offset(self) -> int:
        return len(self.encode())

    def rows_offset(self) -> int:
        end = self.mask_offset() + self.num_rows
        return -(-end // ALIGN) * ALIGN

    def file_size(self) -> int:
        return self.rows_offset() + (0 if self.arena else self.num_rows * self.block_bytes)


def read_header(path: str) -> tuple[TransferHeader, np.ndarray]:
    """A transfer file's header and mask ``[num_groups, num_blocks]`` (bool). ValueError: not a
    transfer file, or truncated (a producer that died while writing, a full disk)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(16)
        if len(head) < 16 or head[:8] != MAGIC:
            raise ValueError(f"{os.path.basename(path)} is not a KV transfer file.")
        (n,) = struct.unpack("<Q", head[8:])
        try:
            header = TransferHeader(**json.loads(f.read(n)))
        except (ValueError, TypeError) as e:
            raise ValueError(f"{os.path.basename(path)} has a broken header: {e}") from None
        if size != header.file_size():
            raise ValueError(
                f"the KV transfer {os.path.basename(path)} is truncated: {size:,} of "
                f"{header.file_size():,} bytes."
            )
        mask = np.frombuffer(f.read(header.num_rows), dtype=np.uint8)
    return header, mask.reshape(header.num_groups, header.num_blocks).astype(bool)
