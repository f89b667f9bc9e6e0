"""Ports chosen in advance for servers on one machine (the demo's, the tests'), safe from races.

A port the kernel picked with ``bind(("", 0))`` comes from its ephemeral range, and is free
again the moment the probing socket closes: the kernel may give it to any outgoing
connection (a gRPC channel, an etcd client, torchrun's store clients) before the server
that was meant to take it binds it.  Servers whose ports must be known before they start (a
coordinator list, torchrun's ``--rdzv-endpoint``) take them from here: below the ephemeral
range, where only an explicit bind can take them, each handed out once per process.
"""

from __future__ import annotations

import random
import socket

__all__ = ["free_port", "port_free"]

_LOW = 10_000                 # above the well-known and most registered service ports
_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768         # Linux's default


def port_free(port: int) -> bool:
    """Whether a server could bind ``port`` now, on loopback and on every address."""
    for host in ("127.0.0.1", "0.0.0.0"):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                return False
    return True


def free_port() -> int:
    """A TCP port no socket holds, outside the kernel's ephemeral range, not handed out before."""
    high = _ephemeral_low()
    if high - _LOW < 1_000:
        raise RuntimeError(f"the ephemeral port range starts at {high}: no room below it for test ports")
    for _ in range(1_000):
        port = random.randrange(_LOW, high)
        if port not in _handed_out and port_free(port):
            _handed_out.add(port)
            return port
    raise RuntimeError("no free port below the ephemeral range after 1000 tries")
