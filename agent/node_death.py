"""When the coordinator calls a node dead: a pure function of (now, what it knows, config).

A node is dead when

* its agent went silent (:meth:`~rankwatch.agent.loadmeter.LoadMeter.silent`, which
  already discounts the coordinator's own overload) while some other node still syncs
  (when every node went quiet at once, the coordinator itself is the one cut off); or
* every one of its ranks died without a clean exit, and stayed so for ``grace`` seconds
  (torchrun's restart of a node's workers kills them all for a moment: the new ones
  come back within it).

A dead node is excluded by the policy (:meth:`Coordinator.exclude`), which also keeps the
job above its minimum node count.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["all_ranks_died", "judge"]


def all_ranks_died(ranks: Iterable[Any]) -> bool:
    """The node ran ranks, and none is connected, alive or exited cleanly (summary ranks)."""
    seen = False
    for r in ranks:
        seen = True
        if r.connected or r.exited_cleanly or r.alive:
            return False
    return seen


def judge(now: float, *, silent: bool, others_live: bool, ranks_died: bool,
          died_since: float | None, grace: float) -> tuple[str | None, float | None]:
    """Why the node is dead (None: it is not), and when its ranks were first all seen dead
    (None while any lives), to be passed back in at the next call."""
    since = (died_since if died_since is not None else now) if ranks_died else None
    if silent and others_live:
        return "its agent went silent", since
    if since is not None and now - since >= grace:
        return "all its ranks died", since
    return None, since
