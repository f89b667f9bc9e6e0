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

What a relay sends on for each node (:func:`send_whole`, pure): the whole summary when
anything the coordinator acts on at once changed since the last one it sent whole (a
rank came, went, died, stopped or changed state; a collective has been in flight for
over ``long_wait_seconds``; a new incident or decision), and at least every
``whole_every_seconds`` (the straggler detector's windows, the ranks' steps and
sequence numbers); otherwise a beat: the node was heard, and its ranks' latest
progress.  A healthy job's summaries then cost the coordinator a beat three times in
four, and a hang, whose ranks wait in a collective, is sent whole within about a
second of its start: well inside the hang allowance.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from rankwatch.proto import pb

Signature = tuple[Any, ...]
"""What of a summary the coordinator acts on at once (:func:`signature`)."""

__all__ = ["RelayConfig", "Signature", "assign", "callers", "send_whole", "signature"]


@dataclass(frozen=True, kw_only=True)
class RelayConfig:
    group_size: int = 64
    """Nodes per relay group; 0 turns relaying off."""
    min_nodes: int = 128
    """Relays only in a job of at least this many nodes."""
    every_seconds: float = 1.0
    """How often the coordinator draws the groups again."""
    whole_every_seconds: float = 1.0
    """A relay sends each node's whole summary at least this often (beats between)."""
    long_wait_seconds: float = 1.0
    """A collective in flight this long makes a node's summary go whole at once."""

    def __post_init__(self) -> None:
        if self.group_size < 0 or self.group_size == 1 or self.min_nodes < 2:
            raise ValueError("RelayConfig needs group_size 0 (off) or >= 2, and min_nodes >= 2")
        if not self.every_seconds > 0 or not self.whole_every_seconds >= 0 or not self.long_wait_seconds > 0:
            raise ValueError("RelayConfig needs every_seconds > 0, whole_every_seconds >= 0, "
                             "long_wait_seconds > 0")


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


def signature(s: pb.NodeSummary, cfg: RelayConfig) -> tuple[Signature, float]:
    """(what of ``s`` must reach the coordinator at once, its ranks' latest progress)."""
    waiting_since = s.sent_at - cfg.long_wait_seconds
    ranks = tuple((r.rank, r.pid, r.connected, r.alive, r.stopped, r.exited_cleanly, r.state, r.activity,
                   r.HasField("inflight") and r.inflight.since <= waiting_since) for r in s.ranks)
    incidents = (len(s.incidents), s.incidents[-1].id if s.incidents else "")
    decisions = (len(s.decisions), s.decisions[-1].id if s.decisions else "")
    progress = max((r.progress_at for r in s.ranks if not r.exited_cleanly), default=0.0)
    return (ranks, incidents, decisions, s.run_id), progress


def send_whole(now: float, sig: Signature, last: tuple[float, Signature] | None, cfg: RelayConfig) -> bool:
    """Whether a relay sends a node's summary whole (else a beat).

    ``last``: (when, signature) of the last summary it sent whole for the node (None:
    none yet, or the coordinator asked for one).
    """
    return last is None or now - last[0] >= cfg.whole_every_seconds or sig != last[1]
