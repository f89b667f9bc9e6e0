"""The agent's stream caps (:class:`StreamLimits`) and how it tells its callers apart
(who gets a seat at a cap: :mod:`.admission`).

:class:`~rankwatch.agent.rpc.gate.Gate` enforces them; the configuration and the CLI build them.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

__all__ = ["StreamLimits", "is_local_peer", "peer_host"]


@dataclass(frozen=True, kw_only=True)
class StreamLimits:
    total: int = 128
    """Streams (Report and Commands) served at once, from everyone."""
    per_peer: int = 32
    """Streams served at once from one TCP host (a node's ranks hold two each)."""
    reserve: int = 32
    """Server threads streams can never take: Status, Sync and RequestCheckpoint run there."""
    hello_timeout: timedelta = timedelta(seconds=5)
    """A Report stream that has sent no hello by then is closed."""
    request_timeout: timedelta = timedelta(seconds=2)
    """A call whose request message has not arrived by then is closed."""
    waiting_per_peer: int = 2
    """Calls that wait for their request message, per TCP host (the Unix socket counts as one)."""
    per_process: int = 4
    """Streams served at once from one process on the Unix socket (known by SO_PEERCRED): a
    rank holds two (Report and Commands), and a reconnect overlaps its old stream briefly."""

    def __post_init__(self) -> None:
        if self.total < 1 or self.per_peer < 1 or self.reserve < 1 or self.waiting_per_peer < 1 \
                or self.per_process < 1:
            raise ValueError("StreamLimits.total, per_peer, reserve, waiting_per_peer and per_process must be at least 1")
        if self.hello_timeout.total_seconds() <= 0 or self.request_timeout.total_seconds() <= 0:
            raise ValueError("StreamLimits.hello_timeout and request_timeout must be positive")

    @property
    def waiting_total(self) -> int:
        """Calls waiting for their request message, in all: half the reserve at most, so the
        other half of the reserved threads always serves calls whose message is there."""
        return max(1, self.reserve // 2)

    @property
    def spare(self) -> int:
        """Streams that may wait, beyond ``total``, to be decided once they identify themselves
        (:mod:`.seats`): an eighth of the reserve (twice that with evicted ones leaving)."""
        return max(1, self.reserve // 8)

    @property
    def threads(self) -> int:
        """The server's thread pool: every stream, plus the reserve for control calls."""
        return self.total + self.reserve


def is_local_peer(peer: str) -> bool:
    """True for a call on a Unix socket (``unix:...``), which needs no token."""
    return peer.startswith("unix:")


def peer_host(peer: str) -> str:
    """The host part of ``context.peer()``: ``ipv4:10.0.0.2:5123`` -> ``ipv4:10.0.0.2``."""
    if is_local_peer(peer):
        return "unix"
    head, _, _port = peer.rpartition(":")
    return head or peer
