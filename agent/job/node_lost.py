"""The ranks a lost node took with it: one ``rank_exit`` with ``how: node_lost`` each.

When the coordinator judges a node dead (:func:`~rankwatch.agent.job.node_death.judge`: its
agent went silent, or all its ranks died and stayed so), each rank that node's agent last
reported streaming (or whose stream it had seen end within :data:`RECENT_SECONDS` of its
last summary), whose end it never told (no ``rank_exit`` of its pid) and that did not finish
cleanly, ended with the node: no one is left to say how.  (A node whose agent lives tells its
ranks' ends itself, within the grace before all-dead counts: none is left for this; nor is
an older worker that a restart stopped.)  Each gets a ``rank_exit`` at the
step it was last seen, with ``how: node_lost``, the why, and ``started_at`` = when it was
last heard (its last word to its agent, or the agent's last summary if that is earlier), on
the coordinator's clock.  The root-cause decision (:mod:`.root_cause`) orders exits by that
time, never by when the silence was confirmed, seconds later, after the survivors' peer
errors were already recorded; and a ``node_lost`` exit is never a consequence.

A pure function of what the coordinator knew of the node; the coordinator records what it
returns (``death_watch.DeathWatch.lost_ranks`` reads the node's last summary for it).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["HOW", "RECENT_SECONDS", "LastSeen", "LostExit", "lost_exits"]

HOW = "node_lost"
RECENT_SECONDS = 10.0
"""A rank whose stream its agent saw end this long before its last summary, without telling
its exit yet (it waits a few seconds for evidence), ended with the node too."""


@dataclass(frozen=True, kw_only=True)
class LastSeen:
    """A rank as its node's last summary showed it, on the coordinator's clock."""

    rank: int
    pid: int
    step: int
    last_seen: float
    """Its last word to its agent (0: none)."""
    connected: bool = True
    exited_cleanly: bool = False


@dataclass(frozen=True, kw_only=True)
class LostExit:
    """One ``rank_exit`` to record: its rank, step and detail."""

    rank: int
    step: int
    detail: dict[str, Any]


def lost_exits(node: str, why: str, *, heard_at: float, now: float, ranks: Iterable[LastSeen],
               told_pids: Collection[int] = ()) -> list[LostExit]:
    """The exits of the ranks that ended with ``node`` (judged dead at ``now`` for ``why``;
    its agent last heard at ``heard_at``), one per rank id (its latest process), by rank.
    ``told_pids``: the processes whose exit the node's agent already reported."""
    latest: dict[int, LastSeen] = {}
    for r in ranks:
        if r.exited_cleanly or (r.pid and r.pid in told_pids):
            continue
        if not r.connected and not heard_at - r.last_seen <= RECENT_SECONDS:
            continue
        held = latest.get(r.rank)
        if held is None or r.last_seen > held.last_seen:
            latest[r.rank] = r
    out = []
    for r in sorted(latest.values(), key=lambda r: r.rank):
        seen = min(r.last_seen, heard_at) if r.last_seen > 0 else heard_at
        out.append(LostExit(rank=r.rank, step=r.step, detail={
            "how": HOW, "why": why, "pid": r.pid, "alive": None, "started_at": seen, "last_seen": seen,
            "last_heard": heard_at, "silent_seconds": round(max(0.0, now - heard_at), 3),
            "evidence": ["node_death"],
            "reason": f"node {node} was lost ({why}); its rank {r.rank} went with it, last seen at step {r.step}"}))
    return out
