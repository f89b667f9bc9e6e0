"""Ports handed out in advance come from below the kernel's ephemeral range, once each."""

from __future__ import annotations

import socket

from rankwatch.agent.cli.ports import free_port, port_free


def _ephemeral_low() -> int:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        return int(f.read().split()[0])


def test_ports_are_below_the_ephemeral_range_and_never_handed_out_twice():
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(10_000 <= p < _ephemeral_low() for p in ports), ports
    for p in ports[:20]:
        assert port_free(p)


def test_a_held_port_is_not_free():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert not port_free(s.getsockname()[1])
