"""Pickled messages over a stream socket between the engine and its worker processes (the
grammar worker, the model workers of the multiprocess executor)."""

from __future__ import annotations

import pickle
import select
import socket
import struct
import time
from typing import Any


def encode(msg: Any) -> bytes:
    """The pickled form of ``msg`` that ``Channel.send_bytes`` sends."""
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


class Channel:
    """Pickled messages over a stream socket, each framed by a 4-byte length: one system call
    to send and, for a message of up to 64 KiB, one to receive (multiprocessing's Connection
    reads the length and the body separately, and its pickler is slower)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = bytearray()

    def send(self, msg: Any) -> None:
        """Pickle ``msg`` and write it whole (blocks while the socket's buffer is full)."""
        self.send_bytes(encode(msg))

    def send_bytes(self, data: bytes) -> None:
        """Write a message ``encode`` made (one pickling for several channels)."""
        self.sock.sendall(struct.pack("<I", len(data)) + data)

    def _message(self) -> Any:
        """The next message: the buffer holds it whole (``_message_ready``)."""
        buf = self._buf
        n = struct.unpack_from("<I", buf)[0]
        msg = pickle.loads(buf[4 : 4 + n])
        del buf[: 4 + n]
        return msg

    def poll(self) -> bool:
        """Whether a message (or the end of the stream) can be read without waiting."""
        if self._message_ready():
            return True
        return bool(select.select([self.sock], [], [], 0)[0])

    def _message_ready(self) -> bool:
        buf = self._buf
        return len(buf) >= 4 and len(buf) >= 4 + struct.unpack_from("<I", buf)[0]

    def recv(self, timeout: float | None = None) -> Any:
        """The next message; EOFError when the other end closed; with ``timeout`` (seconds),
        TimeoutError if no whole message came in that time (a part read stays buffered, so
        the call can be repeated)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._message_ready():
                return self._message()
            if deadline is not None:
                left = max(0.0, deadline - time.monotonic())
                if not select.select([self.sock], [], [], left)[0]:
                    raise TimeoutError(f"no message within {timeout} s")
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise EOFError("the other end closed the channel")
            self._buf += chunk

    def close(self) -> None:
        """Close this end; the other end's ``recv`` then raises EOFError."""
        self.sock.close()
