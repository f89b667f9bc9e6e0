"""Which agent each node syncs through: the coordinator directly, or its group's relay.

One coordinator's Python gRPC server answers a few thousand calls a second on its
core, and a job of 2,048 nodes syncing 4 times a second asks for 8,192.  In a big
job the nodes are split into groups; one agent of each group, its relay, takes its
group's summaries, answers them from the coordinator's last reply, and sends them on
in one ``SyncGroup`` call per interval.  The coordinator then serves one call per
group, and its cost per node is the summary alone.

The rules (:func:`assign`, pure):

* Relays only in a job of at least ``min_nodes`` nodes; below that the coordinator
  serves every node itself, as before.
* Groups are the nodes in node-id order, ``group_size`` at a time, so every
  coordinator (a new one after a takeover too) draws the same groups from the same
  nodes.
* A group's relay is its first *eligible* node: one that gave an address to relay on
  and that the coordinator hears now (not silent, dead or excluded), and not the
  coordinator itself.  A relay that goes silent is replaced at the next assignment;
  its nodes, whose syncs through it fail, sync with the coordinator directly
  meanwhile (``JobLink``), so a dead relay costs its group no verdict.
* A relay syncs with the coordinator itself, as does every node of a group without an
  eligible relay.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["RelayConfig", "assign", "callers"]


@dataclass(frozen=True, kw_only=True)
class RelayConfig:
    group_size: int = 64
    """Nodes per relay group; 0 turns relaying off."""
    min_nodes: int = 128
    """Relays only in a job of at least this many nodes."""
    every_seconds: float = 1.0
    """How often the coordinator draws the groups again."""

    def __post_init__(self) -> None:
        if self.group_size < 0 or self.group_size == 1 or self.min_nodes < 2:
            raise ValueError("RelayConfig needs group_size 0 (off) or >= 2, and min_nodes >= 2")
        if not self.every_seconds > 0:
            raise ValueError("RelayConfig.every_seconds must be > 0")


def assign(nodes: Iterable[tuple[str, str, bool]], cfg: RelayConfig) -> dict[str, str]:
    """Each node's relay address ('' for the coordinator itself).

    ``nodes``: (node id, the address its agent relays on or '', eligible as a relay now).
    A node left out of the result syncs with the coordinator directly.
    """
    known = sorted(nodes)
    if cfg.group_size == 0 or len(known) < cfg.min_nodes:
        return {}
    out: dict[str, str] = {}
    for start in range(0, len(known), cfg.group_size):
        group = known[start:start + cfg.group_size]
        relay = next(((name, addr) for name, addr, ok in group if ok and addr), None)
        if relay is None:
            continue
        for name, _, _ in group:
            out[name] = "" if name == relay[0] else relay[1]
    return out


def callers(assigned: dict[str, str], nodes: int) -> int:
    """Calls the coordinator serves per sync round: the nodes not sent to a relay."""
    return nodes - sum(1 for addr in assigned.values() if addr)
