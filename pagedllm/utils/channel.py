"""Pickled messages over a stream socket between the engine and its worker processes (the
grammar worker, the model workers of the multiprocess executor)."""

from __future__ import annotations

import pickle
import select
import socket
import struct
import time
from typing import Any


class BadMessage:
    """Stands for a message that arrived whole but did not unpickle (the stream stays in
    step: the next message reads normally)."""

    def __init__(self, error: str) -> None:
        self.error = error

    def __getitem__(self, i: int) -> str:  # msg[0] names the kind, as for every message
        return "bad message"


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

    @staticmethod
    def frame(data: bytes) -> bytes:
        """A message ``encode`` made, framed as it travels (for writers that buffer)."""
        return struct.pack("<I", len(data)) + data

    def send_bytes(self, data: bytes) -> None:
        """Write a message ``encode`` made (one pickling for several channels)."""
        self.sock.sendall(self.frame(data))

    def _message(self) -> Any:
        """The next message: the buffer holds it whole (``_message_ready``)."""
        buf = self._buf
        n = struct.unpack_from("<I", buf)[0]
        data = bytes(buf[4 : 4 + n])
        del buf[: 4 + n]
        try:
            return pickle.loads(data)
        except Exception as e:  # e.g. a function the receiver cannot import
            return BadMessage(f"{type(e).__name__}: {e}")

    def poll(self) -> bool:
        """Whether a message (or the end of the stream) can be read without waiting."""
        if self._message_ready():
            return True
        return bool(select.select([self.sock], [], [], 0)[0])

    def has_message(self) -> bool:
        """Whether a whole message is buffered (readable without touching the socket)."""
        return self._message_ready()

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

    def recv_all(self, timeout: float | None) -> list[Any]:
        """Every whole message that has arrived, after waiting up to ``timeout`` seconds (None:
        no limit) for data if none had; [] when nothing whole came. EOFError when the other
        end closed."""
        if not self._message_ready():
            if not select.select([self.sock], [], [], timeout)[0]:
                return []
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise EOFError("the other end closed the channel")
            self._buf += chunk
        return self.feed(b"")

    def feed(self, data: bytes) -> list[Any]:
        """Add bytes read from the socket elsewhere (an event loop's reader); the messages
        they complete."""
        if data:
            self._buf += data
        msgs = []
        while self._message_ready():
            msgs.append(self._message())
        return msgs

    def grow_buffers(self, size: int = 8 << 20) -> None:
        """Ask for large socket buffers (the kernel caps them at its limits), so a burst of
        messages fits without the writer waiting for the reader."""
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                self.sock.setsockopt(socket.SOL_SOCKET, opt, size)
            except OSError:
                pass

    def close(self) -> None:
        """Close this end; the other end's ``recv`` then raises EOFError."""
        self.sock.close()
