"""Which rank holds a copy of each rank's peer snapshot: the buddy map, a pure function.

Each rank sends its snapshot (:mod:`rankwatch.hooks.recovery.snapshot`) to one buddy on
another node.  The nodes form a ring in the order they first appear among the ranks; the
rank at position ``i`` of node ``n`` sends to the rank at position ``i`` (modulo its size)
of node ``n + 1``.  So:

* **one node lost**: every shard lives on: the lost node's ranks' copies are on the next
  node, and the copies the lost node held belong to the previous node, which lives;
* **two nodes lost**: the shards of a node are gone only if the next node in the ring is
  lost with it (both copies).  Of the ``N (N - 1) / 2`` pairs of nodes, the ``N``
  neighbouring pairs lose one node's shards (every pair of 3 nodes); the others lose
  nothing.  A lost pair falls back to the newest complete checkpoint.

A single node has no buddy off itself: its ranks hold no copies (and a lost node then
is the whole job).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["buddy_map", "covered_by", "sources_of"]


def buddy_map(node_of: Sequence[str]) -> list[int]:
    """For each rank (``node_of[rank]`` its node), the rank that holds its copy; the rank
    itself when the job has a single node."""
    nodes: list[str] = []
    ranks: dict[str, list[int]] = {}
    for r, n in enumerate(node_of):
        if n not in ranks:
            nodes.append(n)
            ranks[n] = []
        ranks[n].append(r)
    out = list(range(len(node_of)))
    if len(nodes) < 2:
        return out
    for i, n in enumerate(nodes):
        nxt = ranks[nodes[(i + 1) % len(nodes)]]
        for pos, r in enumerate(ranks[n]):
            out[r] = nxt[pos % len(nxt)]
    return out


def sources_of(buddies: Sequence[int], rank: int) -> list[int]:
    """The ranks whose copies ``rank`` holds (it is their buddy), in rank order."""
    return [r for r, b in enumerate(buddies) if b == rank and r != rank]


def covered_by(node_of: Sequence[str], lost: set[str]) -> list[int]:
    """Ranks whose shards survive the loss of the nodes ``lost``: on their own node or on
    their buddy's (for the docs' and the tests' what-if)."""
    buddies = buddy_map(node_of)
    return [r for r, n in enumerate(node_of) if n not in lost or node_of[buddies[r]] not in lost]
