"""How many nodes the job still has: the coordinator's floor before it excludes one.

The coordinator knows a node from its agent's summaries.  A node whose agent died (a
crashed or killed agent, or an old coordinator's agent whose seat passed on) sends none,
yet its workers go on training with the others, and a new coordinator has never heard of
it at all.  Counting only the nodes it hears would make the coordinator refuse a needed
exclusion ("1 node would remain, below the minimum of 2") while the job has three.

The ranks give such nodes away: every rank reports its world size, so ranks of the current
world that no node reports belong to nodes the coordinator cannot hear.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

__all__ = ["agentless_nodes"]


def agentless_nodes(ranks: Iterable[tuple[str, int, int]], rankless_nodes: int = 0) -> int:
    """Nodes training without an agent the coordinator hears, in whole nodes.

    Args:
        ranks: ``(node, rank, world_size)`` of every connected rank that the coordinator's
            nodes report (excluded and silent nodes included: their ranks are accounted for).
            After an in-process recovery that shrank the world, a survivor's rank and world
            size are those of the new world (``RankSummary.world_rank``): its old rank id may
            lie beyond the new world's size.
        rankless_nodes: known nodes that report no connected rank (starting, or restarting):
            the missing ranks may be theirs, so they are taken off.

    The current world is the largest world size reported; ranks of an older, smaller world
    (before a rejoin) are left out.  A node's share is the most ranks one node reports.
    """
    rows = list(ranks)
    world = max((w for _, _, w in rows), default=0)
    if world <= 0:
        return 0
    per_node: dict[str, int] = {}
    heard: set[int] = set()
    for node, rank, w in rows:
        if w == world and 0 <= rank < world:
            heard.add(rank)
            per_node[node] = per_node.get(node, 0) + 1
    unseen = world - len(heard)
    if unseen <= 0 or not per_node:
        return 0
    return max(0, math.ceil(unseen / max(per_node.values())) - rankless_nodes)
