"""The restart an exclusion starts, as one ``restart`` incident, until the job trains again.

An exclusion makes torchrun restart the workers of every node that stays (or, with
in-process recovery, the survivors regroup in their own processes).  The incident opens
at the decision and is resolved when the job trains again:

* answered in process: at the survivors' recovery (its first step);
* restarted: once every included node has a new worker that completed a step after the
  decision (the workers connected at the decision still step until torchrun stops them);
* superseded: a later exclusion before either, which it lasted until.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from rankwatch.agent.node import recoveries
from rankwatch.agent.durable.decisions import Decision
from rankwatch.agent.durable.incidents import Incident, IncidentLog
from rankwatch.agent.job.global_view import JobView

__all__ = ["Restart", "RestartWatch"]

log = logging.getLogger(__name__)


@dataclass
class Restart:
    incident: str
    """The ``restart`` incident's id."""
    started_at: float
    node: str
    """The excluded node."""
    pids_before: set[int] = field(default_factory=set)
    """The workers connected at the decision: the restart replaces them."""


class RestartWatch:
    def __init__(self, incidents: IncidentLog, view: JobView) -> None:
        self.incidents = incidents
        self.view = view
        self.current: Restart | None = None

    def started(self, d: Decision) -> Incident:
        """Open the restart that exclusion ``d`` starts (closing one it supersedes)."""
        with self.view.lock:
            nodes = self.view.nodes.values()
            step = max((r.step for n in nodes for r in n.summary.ranks), default=-1)
            pids = {r.pid for n in nodes for r in n.summary.ranks if r.connected}
        inc = self.incidents.add(kind="restart", node=d.node, rank=-1, step=step, detected_at=d.decided_at,
                                 detail={"generation": d.generation, "excluded": d.node, "reason": d.reason,
                                         "decision": d.id, "started_at": d.decided_at})
        prev, self.current = self.current, Restart(inc.id, d.decided_at, d.node, pids)
        if prev is not None:  # superseded before it recovered: it lasted until this one
            self.incidents.resolve(prev.incident, d.decided_at, superseded_by=d.id,
                                   recovered_after_seconds=round(d.decided_at - prev.started_at, 3))
        return inc

    def restarting(self, now: float, quiet_seconds: float) -> bool:
        """True within ``quiet_seconds`` of an open restart's decision (its workers are stopped)."""
        r = self.current
        return r is not None and now - r.started_at < quiet_seconds

    def check(self, now: float, job_incidents: list[Incident]) -> None:
        """Resolve the open restart if the job trains again."""
        r = self.current
        if r is None:
            return
        in_process = recoveries.handled_at(r.node, r.started_at, job_incidents)
        if in_process is not None:  # the survivors left the node out in their own processes
            after = round(max(0.0, in_process - r.started_at), 3)
            self.incidents.resolve(r.incident, now, recovered_after_seconds=after, answered_in_process=True)
            log.info("job back to training %.1fs after %s, in process", after, r.incident)
            self.current = None
            return
        with self.view.lock:
            nodes = self.view.live_nodes()
            back = bool(nodes) and all(
                any(x.connected and x.pid not in r.pids_before and x.steps_completed > 0
                    and x.progress_at + n.offset > r.started_at for x in n.summary.ranks)
                for n in nodes)
        if back:
            self.incidents.resolve(r.incident, now, recovered_after_seconds=round(now - r.started_at, 3))
            log.info("job back to training %.1fs after %s", now - r.started_at, r.incident)
            self.current = None
