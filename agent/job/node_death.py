"""When the coordinator calls a node dead: a pure function of (now, what it knows, config).

A node is dead when

* its agent went silent (:meth:`~rankwatch.agent.job.loadmeter.LoadMeter.silent`, which
  already discounts the coordinator's own overload), and that silence is evidence
  (:func:`silence_is_evidence`): some other node still syncs (when every node went quiet
  at once, the coordinator itself is the one cut off), and not many went quiet together
  (a burst of silence is the coordinator's or the network's trouble far more often than
  that many nodes dying in one moment: an overload the load rules had not measured yet, a
  switch between the coordinator and part of the job); or
* every one of its ranks died without a clean exit, and stayed so for ``grace`` seconds
  (torchrun's restart of a node's workers kills them all for a moment: the new ones
  come back within it).

A dead node is excluded by the policy (:meth:`Coordinator.exclude`), which also keeps the
job above its minimum node count.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["all_ranks_died", "burst_size", "judge", "silence_is_evidence"]


def all_ranks_died(ranks: Iterable[Any]) -> bool:
    """The node ran ranks, and none is connected, alive or exited cleanly (summary ranks)."""
    seen = False
    for r in ranks:
        seen = True
        if r.connected or r.exited_cleanly or r.alive:
            return False
    return seen


def silence_is_evidence(silent: int, nodes: int, *, burst_share: float, burst_nodes: int) -> bool:
    """Whether an agent's silence counts against its node while ``silent`` of the job's
    ``nodes`` nodes (those not excluded) are silent: not when all are, nor when more than
    ``burst_nodes`` and than ``burst_share`` of the job are.  (Kubernetes' node controller
    stops evicting in a zone where most nodes look down, for the same reason.)  A rack that
    dies whole stays under both in a big job; positive evidence (ranks reported dead, a hang's
    culprit, a fatal GPU fault) acts whatever this says."""
    return silent < nodes and silent <= burst_size(nodes, burst_share=burst_share, burst_nodes=burst_nodes)


def burst_size(nodes: int, *, burst_share: float, burst_nodes: int) -> float:
    """The most of ``nodes`` nodes taken for dead at once; more falling silent together is
    the coordinator's or the network's trouble (also :func:`pacing.overload`'s scope)."""
    return max(burst_nodes, burst_share * nodes)


def judge(now: float, *, silent: bool, silence_counts: bool, ranks_died: bool,
          died_since: float | None, grace: float) -> tuple[str | None, float | None]:
    """Why the node is dead (None: it is not), and when its ranks were first all seen dead
    (None while any lives), to be passed back in at the next call.  ``silence_counts``:
    :func:`silence_is_evidence` for the job now."""
    since = (died_since if died_since is not None else now) if ranks_died else None
    if silent and silence_counts:
        return "its agent went silent", since
    if since is not None and now - since >= grace:
        return "all its ranks died", since
    return None, since
