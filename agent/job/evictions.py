"""Straggling nodes the coordinator evicts: a checkpoint first, the exclusion once it is saved.

When a straggler costs enough, and when its checkpoint is complete, is decided in
:mod:`~rankwatch.agent.detect.checkpoint_due` (pure functions); this keeps the planned
evictions between evaluations.  The checkpoint request and the exclusion are the
coordinator's policy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable

from rankwatch.agent.durable.incidents import Incident
from rankwatch.agent.detect import checkpoint_due
from rankwatch.agent.durable.decisions import Decision
from rankwatch.agent.job.policy import PolicyConfig

__all__ = ["Evictions"]

log = logging.getLogger(__name__)


class Evictions:
    """Args:
        policy: when a straggler is worth evicting (``evict_straggler_speedup``).
    """

    def __init__(self, policy: PolicyConfig) -> None:
        self.policy = policy
        self._planned: dict[str, tuple[int, str]] = {}   # node -> (checkpoint step, reason)

    def plan(self, node: str, speedup: float, cause: str, excluded: Collection[str],
             checkpoint: Callable[[str], Decision]) -> None:
        """A costly straggling node: checkpoint now (``checkpoint``: the request, raising
        LookupError when no rank could save), exclude it once that checkpoint is complete."""
        if (not checkpoint_due.wants_eviction(speedup, self.policy.evict_straggler_speedup, cause)
                or node in self._planned or node in excluded):
            return
        reason = f"straggler: the job would step {speedup:.2f}x faster without node {node} ({cause})"
        try:
            d = checkpoint(f"before evicting {node}")
        except LookupError:
            return
        self._planned[node] = (d.step, reason)
        log.warning("%s; evicting it after the checkpoint at step %d", reason, d.step)

    def due(self, incidents: Callable[[], Iterable[Incident]]) -> list[tuple[str, str]]:
        """The planned evictions whose checkpoint is saved, each with its reason (no longer
        planned once returned).  ``incidents``: the ones to find the saved checkpoints in."""
        if not self._planned:
            return []
        saved = [i.step for i in incidents() if i.kind == "checkpoint" and i.detail.get("ok")]
        out = []
        for node in checkpoint_due.evictions_due({n: step for n, (step, _) in self._planned.items()}, saved):
            _, reason = self._planned.pop(node)
            out.append((node, reason))
        return out
