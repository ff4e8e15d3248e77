"""A producer's transfer buffer (``kv_buffer_size``), scheduler side: which rows of it each
transfer holds, and the small file that tells a consumer how to open it (the buffer itself:
``worker/kv_arena.py``).

The buffer is ``[rows, row_bytes]`` per tensor-parallel rank (a row is one block of every
layer, the transfer files' rows, ``files.py``); every rank's buffer has the same rows, so the
scheduler places a transfer once for all ranks. A transfer whose rows fit in a free range
gets that range; its file keeps the header and mask only (``TransferHeader.arena``,
``arena_row``). The range goes back when the transfer's files are gone from
``kv_buffer_path`` (the consumer deletes them once its copies are done, the producer's sweep
once nobody took them in time), or at once when the request ends before its prompt does.

The handle file ``<engine_id>.arena.r<rank>`` (JSON, written once per producer start,
replaced atomically): the producer's pid, ``device`` (``cuda``: the buffer's CUDA IPC
handle, ``ipc``; ``cpu``: the shared-memory file that is the buffer, ``data``), ``rows`` and
``row_bytes``. Plain JSON, not a pickle: anyone who can write the directory must not be able
to run code in a consumer.
"""

from __future__ import annotations

import bisect
import json
import os
from typing import Any


def arena_path(directory: str, arena_id: str, rank: int) -> str:
    """The handle file of producer ``arena_id``'s buffer on ``rank``."""
    return os.path.join(directory, f"{arena_id}.arena.r{rank}")


def write_handle(path: str, handle: dict[str, Any]) -> None:
    """Write ``handle`` (JSON) to ``path`` whole or not at all (a temporary file renamed)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(handle, f)
    os.replace(tmp, path)


def read_handle(path: str) -> dict[str, Any]:
    """A handle file's fields; ValueError when it is missing, unreadable, or its producer
    (a GPU buffer's process: its memory went with it) has exited."""
    name = os.path.basename(path)
    try:
        with open(path) as f:
            handle = json.load(f)
        rows, row_bytes, pid = int(handle["rows"]), int(handle["row_bytes"]), int(handle["pid"])
        device = handle["device"]
    except FileNotFoundError:
        raise ValueError(
            f"the producer's KV buffer {name} is gone (the prefill engine exited)."
        ) from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"the producer's KV buffer handle {name} is unreadable: {e}") from None
    if device not in ("cuda", "cpu") or rows < 1 or row_bytes < 1:
        raise ValueError(f"the producer's KV buffer handle {name} is malformed.")
    if device == "cuda" and not _alive(pid):
        raise ValueError(
            f"the producer of the KV buffer {name} (pid {pid}) has exited; its GPU memory "
            "went with it."
        )
    return handle


def check_visible(handle: dict[str, Any], name: str) -> None:
    """ValueError when a GPU buffer's handle names a GPU (``gpu_uuid``) this process does
    not see: CUDA IPC maps only a visible GPU's memory, so the consumer refuses the request
    at its claim rather than fail the step that would load it. (The engine's workers see
    what its core process sees: the same ``CUDA_VISIBLE_DEVICES``.)"""
    uuid = handle.get("gpu_uuid")
    if handle["device"] != "cuda" or uuid is None:
        return
    seen = visible_gpus()
    if seen is not None and uuid not in seen:
        raise gpu_not_seen(str(uuid), name)


def gpu_not_seen(uuid: str, name: str) -> ValueError:
    """The error for a producer's buffer ``name`` on a GPU this process does not see."""
    seen = os.environ.get("CUDA_VISIBLE_DEVICES", "all")
    return ValueError(
        f"the producer's KV buffer {name} is on GPU {uuid}, which this engine does not see "
        f"(CUDA_VISIBLE_DEVICES={seen}); list both engines' GPUs in both, each engine's "
        "first (e.g. 0,1 for the prefill engine and 1,0 for the decode engine), or give "
        "the prefill engine kv_buffer_size 0 (transfers through files)."
    )


def gpu_uuid(index: int) -> str:
    """The UUID of this process's GPU ``index`` (the same GPU under any
    ``CUDA_VISIBLE_DEVICES`` numbering)."""
    import torch

    return str(torch.cuda.get_device_properties(index).uuid)


def gpu_uuids() -> tuple[str, ...]:
    """The UUIDs of the GPUs this process sees, by index (none without CUDA)."""
    import torch

    return tuple(gpu_uuid(i) for i in range(torch.cuda.device_count()))


_VISIBLE: list[frozenset[str]] = []


def visible_gpus() -> frozenset[str] | None:
    """The UUIDs of the GPUs this process sees (found once): none without CUDA; None (not
    known) where CUDA is there but this process has not started it - an engine core whose
    model runs in worker processes - rather than make a CUDA context here for the check
    (the worker's open then names the same error)."""
    if not _VISIBLE:
        import torch

        if not torch.cuda.is_available():
            _VISIBLE.append(frozenset())
        elif not torch.cuda.is_initialized():
            return None
        else:
            _VISIBLE.append(frozenset(gpu_uuids()))
    return _VISIBLE[0]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # (alive, another user's)
        return True
    return True


class ArenaRanges:
    """First-fit placement of transfers in a buffer of ``rows`` rows: contiguous ranges, the
    free ones kept sorted and merged with their neighbours when given back.

    Example (10 rows): take(4) -> 0, take(3) -> 4, take(5) -> -1 (3 rows left), give(0, 4),
    take(2) -> 0 (free now: [2, 4) and [7, 10)), give(4, 3) -> free [2, 10)."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self._starts: list[int] = [0] if rows > 0 else []
        self._lens: list[int] = [rows] if rows > 0 else []

    @property
    def free_rows(self) -> int:
        return sum(self._lens)

    def take(self, n: int) -> int:
        """The first row of a free range of ``n`` rows, now taken (-1: none is that long)."""
        for i, length in enumerate(self._lens):
            if length >= n:
                start = self._starts[i]
                if length == n:
                    del self._starts[i], self._lens[i]
                else:
                    self._starts[i], self._lens[i] = start + n, length - n
                return start
        return -1

    def give(self, start: int, n: int) -> None:
        """Rows ``[start, start + n)`` are free again."""
        i = bisect.bisect(self._starts, start)
        if i > 0 and self._starts[i - 1] + self._lens[i - 1] > start:
            raise ValueError(f"rows {start}..{start + n} are already free")
        self._starts.insert(i, start)
        self._lens.insert(i, n)
        if i + 1 < len(self._starts) and start + n == self._starts[i + 1]:  # with the next
            self._lens[i] += self._lens.pop(i + 1)
            self._starts.pop(i + 1)
        if i > 0 and self._starts[i - 1] + self._lens[i - 1] == start:  # with the previous
            self._lens[i - 1] += self._lens.pop(i)
            self._starts.pop(i)
