"""What this agent knows of the job now: its decisions, the incidents it sees, goodput, and
the coordinator's view while it coordinates.

The ``Status`` view, the node's summary and the job's Prometheus series read the job
through :class:`JobKnowledge`, never through the agent: it is the one place that says
whether this agent coordinates, which incidents it shows, and how goodput is counted
from them.  It reads and never writes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol

from rankwatch.agent.job import goodput
from rankwatch.agent.node.restarting import shown_state

if TYPE_CHECKING:
    from rankwatch.agent.durable.incidents import Incident
    from rankwatch.agent.job.claims import Conflict
    from rankwatch.agent.job.coordinator import Coordinator
    from rankwatch.proto import pb
    from rankwatch.agent.durable.decisions import Decision, DecisionLog
    from rankwatch.agent.relays.relay import Relay
    from rankwatch.agent.node.intake import NodeState

__all__ = ["JobKnowledge", "JobShown"]


class JobShown(Protocol):
    """What the ``Status`` view and the job's Prometheus series read of the coordinator: its
    nodes and their states, the ranks it knows, the rank ids two nodes claim, its relays, the
    job's incidents and a flagged rank's slowdown.  Read only."""

    @property
    def nodes(self) -> Mapping[str, object]: ...
    @property
    def excluded(self) -> Mapping[str, str]: ...
    @property
    def relays(self) -> Mapping[str, str]: ...

    def clock(self) -> float: ...
    def node_states(self) -> dict[str, str]: ...
    def rank_summaries(self) -> list[tuple[str, pb.RankSummary, bool]]: ...
    def rank_conflicts(self, now: float) -> list[Conflict]: ...
    def job_incidents(self) -> list[Incident]: ...
    def slowdown(self, rank: int) -> float | None: ...


class JobKnowledge:
    """Args:
        state: this node's ranks and its own incidents.
        decision_log: the job's decisions this agent made or applied.
        coordinator: this agent's coordinator (it acts only while ``coordinates()``).
        coordinates: whether this agent coordinates the job now (the link's answer).
        coordinator_node: the node whose agent coordinates the job, as far as this agent knows.
        progress: the job's step progress, sampled by the detector loop.
        relay: this agent as a relay for its group, once it serves TCP (None before, or never).
    """

    def __init__(self, state: NodeState, decision_log: DecisionLog, coordinator: Coordinator, *,
                 coordinates: Callable[[], bool], coordinator_node: Callable[[], str],
                 progress: goodput.StepProgress, relay: Callable[[], Relay | None]) -> None:
        self._state = state
        self._log = decision_log
        self._coordinator = coordinator
        self.coordinates = coordinates
        self.coordinator_node = coordinator_node
        self._progress = progress
        self.relay = relay

    @property
    def run_id(self) -> str:
        """The job's run id, as the decision log carries it."""
        return self._log.run_id

    def decisions(self) -> list[Decision]:
        """The job's decisions this agent made or applied (one log, whether it coordinates or not)."""
        return self._log.items

    def view(self) -> JobShown | None:
        """The coordinator's view of the whole job, while this agent coordinates it."""
        return self._coordinator if self.coordinates() else None

    def incidents(self) -> list[Incident]:
        """This agent's incidents, plus, on the coordinator, the other nodes' own."""
        with self._state.lock:
            items = list(self._state.incidents)
        job = self.view()
        if job is not None:
            items += [i for i in job.job_incidents() if i.node != self._state.node_id]
        return items

    def goodput(self, now: float) -> dict[str, float] | None:
        """Where the job's time went (:func:`goodput.breakdown` over this agent's view)."""
        return goodput.breakdown(now, incidents=self.incidents(), decisions=self.decisions(),
                                 progress=self._progress.snapshot())

    def restarting(self, state: str, last_seen: float, now: float) -> bool:
        """Whether a dead rank's worker was stopped by a restart (:mod:`..node.restarting`)."""
        restarts = [d.decided_at for d in self.decisions() if d.kind == "exclude"]
        return shown_state(state, last_seen=last_seen, now=now, restarts=restarts) == "restarting"
