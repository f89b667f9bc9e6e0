"""Detection over one snapshot of ranks: the same pure function on a node and on the coordinator.

A node agent snapshots its own ranks (:func:`rankwatch.agent.node.rank_snapshot.snapshot`);
the coordinator snapshots every included rank of the job from the nodes'
summaries (:meth:`Coordinator.snapshot`).  Both run :func:`evaluate` over theirs,
so a hang incident's content is decided here once, whoever detects it, and the
straggler detector is fed the same inputs on both sides.

What stays with the caller is what a verdict *does*: record the incident (on the
coordinator :class:`~rankwatch.agent.job.hang_watch.HangWatch`, on a node
:class:`~rankwatch.agent.node.sweep.NodeWatch`), mark the rank
(:func:`rankwatch.agent.node.transitions.next_state`), and on the coordinator apply the
policy (an exclusion).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

from rankwatch.agent.detect.hang_verdict import HangConfig, HangVerdict, RankProgress, detect_hang, flight_recorder_evidence
from rankwatch.agent.detect.straggler import RankWork, StragglerEvent

__all__ = ["STACKS_FRESH_SECONDS", "HangFinding", "Snapshot", "Verdicts", "evaluate", "straggler_detail"]

STACKS_FRESH_SECONDS = 10.0
"""Stacks and Flight Recorder extracts older than this are not evidence of the present."""


@dataclass(frozen=True, kw_only=True)
class Snapshot:
    """The ranks one detector watches, on its own clock.

    ``stacks`` and ``flight_recorder`` of each rank are set only when fresh.
    """

    ranks: list[RankProgress]
    scope: Literal["node", "job"]
    nodes: tuple[str, ...] = ()
    """The job's nodes (job scope): named in a job hang's evidence."""
    silent_nodes: frozenset[str] = field(default_factory=frozenset)
    """Nodes whose agent stopped syncing (job scope)."""


@dataclass(frozen=True, kw_only=True)
class HangFinding:
    """A ``hang`` incident to record: where, and its evidence (``status --json`` contract)."""

    node: str
    rank: int
    step: int
    detail: dict[str, Any]
    verdict: HangVerdict


@dataclass(frozen=True, kw_only=True)
class Verdicts:
    hang: HangFinding | None
    """The job (or node) is hung, and who is stuck; None while it progresses."""
    snapshot: Snapshot

    @cached_property
    def work(self) -> list[RankWork]:
        """The straggler detector's inputs: each connected rank's recent steps (built when asked).
        The windows are the snapshot's own, not copies: the detector only reads them, and at
        16,384 ranks of 64-step windows copying them cost more than everything else."""
        return [RankWork(rank=r.rank, node=r.node, step=r.step, own=r.own, data=r.data,
                         wait=r.wait, step_seconds=r.step_seconds, completed=r.steps_completed, period=r.period,
                         role=r.role)
                for r in self.snapshot.ranks if r.connected]


def evaluate(now: float, snap: Snapshot, hang: HangConfig) -> Verdicts:
    """Run the detectors' pure part once over ``snap``."""
    verdict = detect_hang(now, snap.ranks, hang) if snap.ranks else None
    return Verdicts(hang=_hang_finding(now, verdict, snap) if verdict is not None else None, snapshot=snap)


def _hang_finding(now: float, verdict: HangVerdict, snap: Snapshot) -> HangFinding:
    c = verdict.culprit
    silent_node = c.node in snap.silent_nodes
    detail: dict[str, Any] = {
        "collective": verdict.collective, "alive": None if silent_node else c.alive,
        "stopped": c.stopped and not silent_node, "stacks": c.stacks, "reason": verdict.reason,
        "pid": c.pid or None, "stalled_seconds": round(verdict.stalled_for, 3),
        "allowance_seconds": round(verdict.allowance, 3), "silent_ranks": verdict.silent,
        "started_at": round(now - verdict.stalled_for, 3), "inflight": c.inflight,
        "flight_recorder": flight_recorder_evidence(snap.ranks),
    }
    if verdict.p2p is not None:
        detail["p2p"] = verdict.p2p
    if snap.scope == "job":
        detail.update(nodes=sorted(snap.nodes), scope="job")
    if c.stacks is None:
        detail["stacks_note"] = (
            "the node's agent is silent" if silent_node else
            "the process is stopped (SIGSTOP): its threads cannot run" if c.stopped else
            "no stacks: the rank's sender thread is silent" if c.rank in verdict.silent else
            "no fresh stacks yet: the step had not run long enough for the rank to send them")
    return HangFinding(node=c.node, rank=c.rank, step=c.step, detail=detail, verdict=verdict)


def straggler_detail(event: StragglerEvent, window: int, scope: Literal["node", "job"]) -> dict[str, Any]:
    """A ``straggler`` incident's detail; the coordinator's carry ``job: true``."""
    detail = event.detail(window)
    if scope == "job":
        detail["job"] = True
    return detail
