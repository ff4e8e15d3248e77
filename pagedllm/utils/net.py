"""Small network helpers."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the OS's pick; another process may take it before
    the caller binds it, which the callers accept). ``host`` "" asks for all interfaces."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
