"""Stragglers across nodes, as the coordinator sees them.

A node's own agent compares its ranks with each other.  The coordinator runs the same
detector over every rank of the job and adds what no node can see alone: a whole slow
node, or a node's only rank.  Each flag is a job ``straggler`` incident, resolved once
none of its ranks is flagged; the coordinator's policy decides what a costly one costs
the node (``job/coordinator.py``: a checkpoint, then eviction).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from rankwatch.agent.detect.evaluate import straggler_detail
from rankwatch.agent.durable.incidents import Incident, IncidentLog
from rankwatch.agent.detect.straggler import RankWork, StragglerConfig, StragglerDetector

__all__ = ["Flagged", "JobStragglers"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Flagged:
    node: str
    speedup: float
    """How much faster the job would step without the node."""
    cause: str


class JobStragglers:
    def __init__(self, cfg: StragglerConfig, incidents: IncidentLog,
                 on_incident: Callable[[Incident], None]) -> None:
        self.cfg = cfg
        self.incidents = incidents
        self._on_incident = on_incident
        self._detector = StragglerDetector(cfg)
        self._open: dict[int, str] = {}   # flagged rank -> its open incident's id
        self._evaluated_steps = 0

    def slowdown(self, rank: int) -> float | None:
        """A rank's slowdown as the job sees it while it is flagged here; None otherwise (the
        coordinator keeps no score for the others; their own nodes' agents may)."""
        score = self._detector.flagged.get(rank)
        return None if score is None else score.slowdown

    def update(self, now: float, work: list[RankWork]) -> list[Flagged]:
        """Run the detector once every rank completed a new step; return the new flags."""
        if len(work) < 2 or len({w.node for w in work}) < 2:
            return []  # one node: its own agent decides
        per_node: dict[str, int] = {}
        for w in work:
            per_node[w.node] = per_node.get(w.node, 0) + 1
        done = min(w.completed for w in work)
        if done == self._evaluated_steps:
            return []
        self._evaluated_steps = done
        flagged = []
        for ev in self._detector.update(work, done):
            if ev.kind == "cleared":
                self._resolve(ev.score.rank, now)
                continue
            if ev.scope != "node" and per_node[ev.work.node] > 1:
                continue   # its node's agent compares it with its neighbours
            inc = self.incidents.add(kind="straggler", node=ev.work.node, rank=ev.score.rank,
                                     step=ev.work.step, detected_at=now,
                                     detail=straggler_detail(ev, self.cfg.window, "job"))
            for rank in ev.ranks or [ev.score.rank]:
                self._open[rank] = inc.id
            self._on_incident(inc)
            flagged.append(Flagged(ev.work.node, ev.score.speedup, ev.score.cause))
        return flagged

    def _resolve(self, rank: int, now: float) -> None:
        """A rank's flag is lifted; its incident is resolved once none of its ranks is flagged.
        The resolved incident reaches the node with the next sync, which unmarks its ranks."""
        inc = self._open.pop(rank, None)
        if inc is None or inc in self._open.values():
            return
        resolved = self.incidents.resolve(inc, now)
        if resolved is not None:
            log.info("job straggler %s resolved", inc)
            self._on_incident(resolved)
