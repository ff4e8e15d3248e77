"""A producer's transfer buffer, worker side: the memory itself, and a consumer's views of
the producers' buffers it reads (the placement and the handle file's format:
``core/kv_transfer/arena.py``).

- On a GPU the buffer is device memory (made before the KV cache is sized, so the memory
  profile counts it); a consumer opens it by its CUDA IPC handle and copies rows device to
  device (between two GPUs of one host: peer to peer). The consumer must see the producer's
  GPU, which it finds by its UUID (``local_gpu``): e.g. ``CUDA_VISIBLE_DEVICES=0,1`` for the
  producer and ``1,0`` for the consumer, each engine on its first GPU.
- On a CPU it is a shared-memory file in ``kv_buffer_path`` both engines map.

A GPU buffer's own process cannot open its IPC handle (CUDA refuses): a consumer in the
producer's process (an engine in both roles, two engines of one process) uses the tensor.
"""

from __future__ import annotations

import base64
import os
import weakref
from collections import OrderedDict
from typing import Any

import torch

from pagedllm.core.kv_transfer.arena import (
    arena_path,
    gpu_not_seen,
    gpu_uuid,
    gpu_uuids,
    read_handle,
    write_handle,
)

MAX_OPEN = 8  # producers' buffers a consumer keeps open (the least recently used closes)
_IN_PROCESS: weakref.WeakValueDictionary[str, ProducerArena] = weakref.WeakValueDictionary()


class ProducerArena:
    """This rank's buffer ``rows`` ``[n, row_bytes]`` (uint8) and its handle file, deleted
    when the engine goes."""

    def __init__(
        self, directory: str, arena_id: str, rank: int, n: int, row_bytes: int,
        device: torch.device,
    ) -> None:  # fmt: skip
        path = arena_path(directory, arena_id, rank)
        handle: dict[str, Any] = {
            "pid": os.getpid(), "device": device.type, "rows": n, "row_bytes": row_bytes,
        }  # fmt: skip
        files = [path]
        if device.type == "cuda":
            self.rows = torch.empty(n, row_bytes, dtype=torch.uint8, device=device)
            handle["ipc"] = _ipc_handle(self.rows)
            # (the GPU by its UUID: a consumer's CUDA_VISIBLE_DEVICES may number it otherwise)
            handle["gpu_uuid"] = gpu_uuid(self.rows.device.index)
            _IN_PROCESS[path] = self
        else:
            data = path + ".data"
            files.append(data)
            tmp = data + ".tmp"  # (a consumer never maps a half-made file)
            _unlink_all([(tmp, _inode(tmp))])  # (one a crashed start left: its size)
            self.rows = torch.from_file(tmp, shared=True, size=n * row_bytes, dtype=torch.uint8)
            self.rows = self.rows.view(n, row_bytes)
            os.replace(tmp, data)
            handle["data"] = os.path.basename(data)
        write_handle(path, handle)
        # (by inode: a producer restarted under this id in this process keeps its own files)
        owned = [(f, os.stat(f).st_ino) for f in files]
        weakref.finalize(self, _unlink_all, owned)  # (at exit too)


class ArenaViews:
    """The producers' buffers this rank has opened (by buffer id and handle file: a producer
    that restarted under the same id has a new file, so a new view)."""

    def __init__(self, directory: str, rank: int) -> None:
        self.dir, self.rank = directory, rank
        self._open: OrderedDict[str, tuple[tuple[int, int], torch.Tensor]] = OrderedDict()

    def rows(self, arena_id: str) -> torch.Tensor:
        """Producer ``arena_id``'s buffer ``[n, row_bytes]`` on this rank (ValueError: gone)."""
        path = arena_path(self.dir, arena_id, self.rank)
        try:
            st = os.stat(path)
        except OSError:
            read_handle(path)  # (raises, naming it)
            raise
        key = (st.st_ino, st.st_mtime_ns)
        hit = self._open.get(arena_id)
        if hit is not None and hit[0] == key:
            self._open.move_to_end(arena_id)
            return hit[1]
        handle = read_handle(path)
        n, row_bytes = int(handle["rows"]), int(handle["row_bytes"])
        own = _IN_PROCESS.get(path) if int(handle["pid"]) == os.getpid() else None
        if own is not None:
            rows = own.rows
        elif handle["device"] == "cuda":
            rows = _open_ipc(handle["ipc"], local_gpu(handle, arena_id))
        else:
            data = os.path.join(self.dir, os.path.basename(str(handle["data"])))
            rows = torch.from_file(data, shared=True, size=n * row_bytes, dtype=torch.uint8)
        rows = rows.view(n, row_bytes)
        self._open[arena_id] = (key, rows)
        self._open.move_to_end(arena_id)
        while len(self._open) > MAX_OPEN:
            self._open.popitem(last=False)
        return rows


def _ipc_handle(t: torch.Tensor) -> dict[str, Any]:
    """What a consumer needs to open ``t`` (a whole CUDA allocation's tensor) by CUDA IPC:
    ``torch.multiprocessing``'s own reduction of it, as JSON (bytes in base64)."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(t)
    (_, size, stride, offset, storage_cls, dtype, device, handle, storage_bytes,
     storage_offset, _, ref_handle, ref_offset, event_handle, event_sync) = args  # fmt: skip
    b64 = _b64
    return {
        "size": list(size), "stride": list(stride), "offset": offset,
        "storage_cls": storage_cls.__name__, "device": device, "handle": b64(handle),
        "storage_bytes": storage_bytes, "storage_offset": storage_offset,
        "ref_handle": b64(ref_handle), "ref_offset": ref_offset,
        "event_handle": b64(event_handle), "event_sync": bool(event_sync),
    }  # fmt: skip


def local_gpu(handle: dict[str, Any], name: str = "") -> int:
    """This process's index of the GPU holding a producer's buffer (found by its UUID;
    ValueError when this process cannot see it: CUDA IPC maps only a visible GPU's memory).

    Example: producer with CUDA_VISIBLE_DEVICES=0,1 on its cuda:0 (physical GPU 0); a
    consumer with CUDA_VISIBLE_DEVICES=1,0 finds that GPU at its index 1."""
    uuid = handle.get("gpu_uuid")
    if uuid is None:  # (a handle without it: the producer's own index)
        return int(handle["ipc"]["device"])
    uuids = gpu_uuids()
    if uuid not in uuids:
        raise gpu_not_seen(uuid, name)
    return uuids.index(uuid)


def _open_ipc(h: dict[str, Any], device: int) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    storage_cls = {"TypedStorage": torch.storage.TypedStorage,
                   "UntypedStorage": torch.UntypedStorage}.get(h["storage_cls"])  # fmt: skip
    if storage_cls is None:
        raise ValueError(f"a KV buffer handle names an unknown storage {h['storage_cls']!r}")

    def raw(v: Any) -> bytes | None:
        return None if v is None else base64.b64decode(v)

    return rebuild_cuda_tensor(
        torch.Tensor, torch.Size(h["size"]), tuple(h["stride"]), int(h["offset"]),
        storage_cls, torch.uint8, device, raw(h["handle"]),
        int(h["storage_bytes"]), int(h["storage_offset"]), False, raw(h["ref_handle"]),
        int(h["ref_offset"]), raw(h["event_handle"]), bool(h["event_sync"]),
    )  # fmt: skip


def _b64(v: Any) -> str | None:
    return None if v is None else base64.b64encode(bytes(v)).decode()


def _inode(path: str) -> int:
    try:
        return os.stat(path).st_ino
    except OSError:
        return -1


def _unlink_all(owned: list[tuple[str, int]]) -> None:
    for path, ino in owned:
        try:
            if os.stat(path).st_ino == ino:
                os.unlink(path)
        except OSError:
            pass
