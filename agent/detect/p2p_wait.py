"""Who waits on whom in point-to-point: a pipeline hang's two ends, and P2P deadlocks.

A pipeline stage blocked in a ``send`` or ``recv`` (its in-flight record names the other
end, ``peer``, as a world rank) waits on one rank, not on a whole group.  Followed from a
waiting rank, those edges end at the rank that holds the pipeline up (it is silent,
stopped, outside any operation, or in another collective), or they close a cycle: a P2P
deadlock, two stages each waiting for the other.

Pure functions of the ranks' progress; :func:`~.hang_verdict.detect_hang` calls them once it
has a verdict, and the hang incident carries their evidence as ``detail.p2p``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

__all__ = ["P2P_OPS", "deadlock", "describe", "ends", "waits_on"]

P2P_OPS = frozenset({"send", "recv"})


class _Rank(Protocol):
    rank: int
    role: int
    inflight: dict[str, Any] | None
    progress_at: float


R = TypeVar("R", bound=_Rank)


def waits_on(ranks: Sequence[_Rank]) -> dict[int, int]:
    """``{rank: the peer it waits on}`` for the ranks inside a send or receive with a known peer."""
    out = {}
    for r in ranks:
        i = r.inflight
        if i is not None and i.get("op") in P2P_OPS and i.get("peer", -1) >= 0 and i["peer"] != r.rank:
            out[r.rank] = i["peer"]
    return out


def deadlock(ranks: Sequence[R]) -> list[R] | None:
    """The ranks of a P2P wait cycle (each waits on the next, the last on the first), lowest
    rank first; None: no cycle.  Linear in the ranks: each is walked from once."""
    edges = waits_on(ranks)
    by_rank = {r.rank: r for r in ranks}
    done: set[int] = set()
    for start in sorted(edges):
        path: list[int] = []
        on_path: set[int] = set()
        node: int | None = start
        while node is not None and node not in done and node not in on_path:
            path.append(node)
            on_path.add(node)
            node = edges.get(node)
        done.update(path)
        if node is not None and node in on_path:
            cycle = path[path.index(node):]
            first = cycle.index(min(cycle))
            return [by_rank[n] for n in cycle[first:] + cycle[:first]]
    return None


def ends(waiting: Sequence[_Rank], culprit: _Rank) -> dict[str, Any] | None:
    """The evidence that a rank waits in a send or receive on ``culprit``: both ends (ranks,
    stages, ops) and the microbatches they began last; None: no rank waits on it in P2P."""
    edges = waits_on(waiting)
    waiter = min((r for r in waiting if edges.get(r.rank) == culprit.rank), key=lambda r: r.rank, default=None)
    if waiter is None:
        return None
    w, c = waiter.inflight or {}, culprit.inflight or {}
    return {"waiter": waiter.rank, "waiter_stage": waiter.role, "op": w.get("op"),
            "microbatch": w.get("microbatch"), "microbatch_pass": w.get("microbatch_pass"),
            "peer": culprit.rank, "peer_stage": culprit.role,
            "peer_op": c.get("op"), "peer_microbatch": c.get("microbatch"),
            "peer_microbatch_pass": c.get("microbatch_pass")}


def describe(p2p: dict[str, Any]) -> str:
    """One sentence for a hang's reason: who waits in what on whom, in which microbatch."""
    direction = "from" if p2p["op"] == "recv" else "to"
    where = (f" (its {p2p['microbatch_pass'] or 'pipeline'} microbatch {p2p['microbatch']})"
             if p2p.get("microbatch") is not None else "")
    theirs = f", which waits in {p2p['peer_op']}" if p2p.get("peer_op") else ""
    return (f"rank {p2p['waiter']} (stage {p2p['waiter_stage']}) waits in {p2p['op']} {direction} "
            f"rank {p2p['peer']} (stage {p2p['peer_stage']}){where}{theirs}")
