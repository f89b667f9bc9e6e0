"""The coordinator's word about this node's ranks, applied to them: an exclusion of the node
marks every rank excluded, and a job incident about one of its ranks (a hang's culprit, a
job-wide straggler) is kept in the node's own log and marks or lifts the rank's state."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from rankwatch.agent.durable.incidents import Incident, IncidentLog

if TYPE_CHECKING:
    from rankwatch.agent.durable.decisions import Decision
    from rankwatch.agent.node.sweep import NodeWatch
    from rankwatch.proto import pb

__all__ = ["JobVerdicts"]

log = logging.getLogger(__name__)


class JobVerdicts:
    """Args:
        node: this node's id.
        incidents: this node's incident log.
        watch: the node's detectors, whose ranks' states the verdicts mark and lift.
    """

    def __init__(self, node: str, incidents: IncidentLog, watch: NodeWatch) -> None:
        self._node, self._incidents, self._watch = node, incidents, watch

    def exclusion(self, decision: Decision) -> None:
        """A coordinator decision: mark this node's ranks excluded."""
        if decision.node == self._node:
            self._watch.exclude_all()
            log.warning("this node is excluded from the job: %s", decision.reason)

    def job_incident(self, coordinator: str, inc: pb.Incident) -> None:
        """A job incident the coordinator decided about one of this node's ranks.

        Kept under ``<coordinator>/<id>``; a later change (its resolution) is recorded as an
        update of the copy, so this node's file tells the story too.
        """
        incident = Incident.from_pb(inc, id=f"{coordinator}/{inc.id}")
        if self._incidents.merge(incident):
            self._watch.mark(incident)
            return
        self._incidents.update(incident.id, **incident.detail)
        if incident.resolved_at is not None:
            self._watch.lift(incident)

    def own_job_incident(self, incident: Incident) -> None:
        """The coordinator's verdict about a rank of the coordinator's own node."""
        if incident.node != self._node:
            return
        if incident.resolved_at is not None:
            self._watch.lift(incident)
        else:
            self._watch.mark(incident)
