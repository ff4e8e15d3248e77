"""``free_port``: the ports handed to the engines' listeners (the cores' store, the workers'
group, servers in tests) come from below the OS's ephemeral range, where no outgoing
connection or ``bind(0)`` listener of the host can take them between the pick and the bind."""

from __future__ import annotations

import socket

from pagedllm.utils import net


def test_ports_come_from_below_the_ephemeral_range_and_bind():
    lo, _ = net._ephemeral_range()
    ports = {net.free_port() for _ in range(20)}
    assert len(ports) > 1  # (random, not the same port every time)
    for port in ports:
        assert net._LOW <= port < lo
    with socket.create_server(("127.0.0.1", ports.pop())):
        pass


def test_a_held_port_is_skipped_and_a_low_range_falls_back_to_the_os(monkeypatch):
    with socket.create_server(("127.0.0.1", 0)) as held:
        taken = held.getsockname()[1]
        monkeypatch.setattr(net, "_ephemeral_range", lambda: (taken + 1, 60999))
        monkeypatch.setattr(net, "_LOW", taken - 999)  # 1,000 ports; one held
        assert all(net.free_port() != taken for _ in range(50))
        monkeypatch.setattr(net, "_LOW", taken)  # no room below the range: the OS picks
        assert net.free_port() != taken
