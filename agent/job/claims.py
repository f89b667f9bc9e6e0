"""Who speaks for a node id and for a rank id: the coordinator's rules against a second claimant.

Every token holder may send a summary (with a token only, every holder is trusted alike:
docs/security.md), so two connections can claim the same thing.  Two rules keep the job's
view whole, in both modes (token only and mutual TLS):

* **A node id belongs to one agent instance at a time.**  Each agent sends a random instance
  id it draws at start (``NodeSummary.agent_instance``, never shown).  A summary for a node id
  whose current instance is still *holding* it (:func:`holding`) but that carries another
  instance id is refused whole (``node_taken``): a second connection cannot take a live
  agent's node over.  An agent that restarted gets its node back once the old instance has
  missed a few syncs.
* **A rank id belongs to one node at a time.**  A rank a summary claims (connected and not
  exited cleanly) that another node holds, and that node is still holding its claims, is a
  *conflict*: that rank is left out of the claimant's summary (never a second rank of the same
  id), the refusal is counted (``rank_conflict``), and the conflict is shown in ``status``
  until the claimant stops claiming it.  The first holder keeps it; once it stops syncing,
  is excluded or dead, the claim lapses and the next claimant takes it.  A rank that moved
  between nodes in a restart is a conflict for at most the old holder's next sync.

A claim *holds* while its node is heard within :data:`HOLD_INTERVALS` of the interval it was
told to sync at, and never less than :data:`HOLD_FLOOR_SECONDS`: shorter than the silence
that makes a node dead (a node lost with its agent gives its ranks up within about a second),
longer than the jitter of a node that syncs on time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

__all__ = ["HOLD_FLOOR_SECONDS", "HOLD_INTERVALS", "Conflict", "RankClaims", "claimed_ranks", "holding",
           "refused_ranks", "takeover_refused"]

HOLD_INTERVALS = 4.0
"""Sync intervals a node may miss and still hold its node id and its ranks."""
HOLD_FLOOR_SECONDS = 1.5
"""The shortest hold, whatever the interval."""
MAX_CONFLICTS = 1024
"""The most conflicts kept for ``status`` (the oldest go first)."""


def holding(now: float, received_at: float, interval: float) -> bool:
    """Whether a node last heard at ``received_at``, told to sync every ``interval`` s, still
    holds its node id and the ranks it claims."""
    return now - received_at <= max(HOLD_INTERVALS * interval, HOLD_FLOOR_SECONDS)


def takeover_refused(held: str, instance: str, holder_holds: bool) -> bool:
    """Whether a summary from agent ``instance`` is refused for a node whose summaries came
    from ``held`` ("": an agent that sends none, whose node id anyone may take)."""
    return bool(held) and instance != held and holder_holds


def claimed_ranks(ranks: Iterable[tuple[int, bool, bool]]) -> dict[int, int]:
    """``{rank id: its index}`` of the ranks a summary claims, from ``(rank id, connected,
    exited cleanly)`` in summary order (a rank that ended cleanly claims nothing)."""
    return {rank: i for i, (rank, connected, exited) in enumerate(ranks) if connected and not exited}


def refused_ranks(node: str, claimed: Iterable[int], holders: Mapping[int, str],
                  holds: Callable[[str], bool]) -> set[int]:
    """The rank ids of ``claimed`` (by ``node``) that another node holds and still ``holds``."""
    out = set()
    for rank in claimed:
        holder = holders.get(rank)
        if holder is not None and holder != node and holds(holder):
            out.add(rank)
    return out


@dataclass
class Conflict:
    """A rank id claimed by a second node while its first holder held it."""

    rank: int
    holder: str
    claimant: str
    since: float
    """When the claim was first refused (the coordinator's clock)."""
    last: float
    """When it was last refused."""
    refused: int = 1
    """Summaries whose claim to the rank was refused."""


class RankClaims:
    """Which node holds each rank id, and the conflicts open now (the job view's, under its lock)."""

    def __init__(self) -> None:
        self.holders: dict[int, str] = {}
        self.conflicts: dict[tuple[int, str], Conflict] = {}

    def settle(self, node: str, claimed: dict[int, int], before: Iterable[int],
               holds: Callable[[str], bool], now: float) -> set[int]:
        """Take ``node``'s claims (``before``: the ranks its previous summary held); the rank
        ids refused (:func:`refused_ranks`) are returned, and recorded as conflicts."""
        refused = refused_ranks(node, claimed, self.holders, holds)
        for rank in before:
            if rank not in claimed and self.holders.get(rank) == node:
                del self.holders[rank]
        for rank in claimed:
            if rank not in refused:
                self.holders[rank] = node
        self._record(node, refused, now)
        return refused

    def _record(self, node: str, refused: set[int], now: float) -> None:
        """Open or refresh ``node``'s conflicts; close those it no longer makes."""
        for key in [k for k in self.conflicts if k[1] == node and k[0] not in refused]:
            del self.conflicts[key]
        for rank in refused:
            held = self.conflicts.get((rank, node))
            if held is not None:
                held.last, held.refused, held.holder = now, held.refused + 1, self.holders[rank]
                continue
            if len(self.conflicts) >= MAX_CONFLICTS:
                del self.conflicts[min(self.conflicts, key=lambda k: self.conflicts[k].last)]
            self.conflicts[(rank, node)] = Conflict(rank, self.holders[rank], node, now, now)

    def open(self, holds: Callable[[str], bool]) -> list[Conflict]:
        """The conflicts whose claimant still claims the rank (it still holds its own claims)."""
        return sorted((c for c in self.conflicts.values() if holds(c.claimant)), key=lambda c: (c.rank, c.since))
