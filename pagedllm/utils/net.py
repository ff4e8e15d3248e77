"""Small network helpers."""

from __future__ import annotations

import random
import socket

_LOW = 10_000  # the lowest port ``free_port`` hands out (above the usual services)


def _ephemeral_range() -> tuple[int, int]:
    """The range the OS picks outgoing and ``bind(0)`` ports from (Linux's default where
    ``/proc`` does not say)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def _binds(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, for a listener another process binds later.

    Picked at random below the OS's ephemeral range (e.g. from 10000-32767 where the range
    is 32768-60999): a port the OS picked with ``bind(0)`` would be handed again, before the
    caller binds it, to any of the outgoing connections and ``bind(0)`` listeners of a busy
    host (gloo opens dozens), and the listener would fail with EADDRINUSE; below the range
    only another ``free_port`` caller's pick can collide (1 in ~20,000). Where the range
    starts too low to leave room, the OS's pick. ``host`` "" asks for all interfaces."""
    lo, _ = _ephemeral_range()
    if lo - _LOW >= 1000:
        rng = random.SystemRandom()
        for _ in range(64):
            port = rng.randrange(_LOW, lo)
            if _binds(host, port):
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
