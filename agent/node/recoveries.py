"""In-process recoveries as the agents record them: one ``restart`` incident per recovery.

The fast recovery tier keeps the training processes: the survivors of a lost node leave
the failed step, agree on a new membership, rebuild their process groups and mesh, and
go on.  Each surviving rank reports it (``RecoveryRecord``), so a node with eight ranks
hears of one recovery eight times, and a job of many nodes once per node.

The rule that makes one incident of them (:func:`same`): two reports are the same
recovery when they name the same step, the same old and new world sizes and the same
outcome, and were caught within :data:`MATCH_SECONDS` of each other.  The ranks of a node
catch a failure within about a second of each other (a rank busy computing reaches the
broken collective up to a step later), so the window is wide; a second attempt at the
same step and worlds that ends the same way within it is taken for the first.  The node
agent applies the rule to its ranks' reports (:class:`RecoveryLog`), the coordinator to
the nodes' incidents (``views.status_response``), on its own clock.

The incident is of kind ``restart`` (the contract's kinds) with ``detail["tier"] ==
"in_process"``; a torchrun restart decided by the coordinator carries no tier.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

from rankwatch.agent.durable.incidents import Incident, IncidentLog
from rankwatch.agent.wire.ranges import RECOVERY_PHASES, clean_text
from rankwatch.proto import pb

__all__ = ["MATCH_SECONDS", "TIER", "RecoveryLog", "detail", "is_in_process", "same", "span"]

TIER = "in_process"
MATCH_SECONDS = 10.0
"""Reports of one recovery are caught at most this far apart (seconds)."""
_KEPT = 256   # recent recoveries a node agent matches reports against


def detail(rec: pb.RecoveryRecord) -> dict[str, Any]:
    """The incident detail of a (validated) record: with ``recomputed_steps`` where the failure
    cut a later step than the one training goes on from (a peer snapshot's), and the snapshot's
    copy and send where the rank takes them."""
    out = {"tier": TIER, "ok": rec.ok, "step": rec.step, "old_world_size": rec.old_world_size,
           "new_world_size": rec.new_world_size, "dropped_nodes": list(rec.dropped_nodes),
           "phases": {name: round(rec.phases[name], 6) for name in RECOVERY_PHASES if name in rec.phases},
           "error": clean_text(rec.error), "started_at": rec.started_at}
    if rec.HasField("failed_at"):
        out["recomputed_steps"] = max(0, rec.failed_at - rec.step)
    if rec.HasField("snapshot"):
        s = rec.snapshot
        out["snapshot"] = {"step": s.step, "copy_seconds": round(s.copy_seconds, 6),
                           "send_seconds": round(s.send_seconds, 6), "bytes": s.sent_bytes}
    return out


def is_in_process(inc: Incident) -> bool:
    return inc.kind == "restart" and inc.detail.get("tier") == TIER


def same(a: Incident, b: Incident) -> bool:
    """Whether two in-process recovery incidents record one recovery (the module's rule)."""
    da, db = a.detail, b.detail
    return (all(da.get(k) == db.get(k) for k in ("step", "old_world_size", "new_world_size", "ok"))
            and abs(a.detected_at - b.detected_at) <= MATCH_SECONDS)


def seconds(phases: Mapping[str, Any]) -> float:
    """How long the recovery took: until its first step, else until the last phase it reached."""
    if "first_step" in phases:
        return float(phases["first_step"])
    return max((float(v) for k, v in phases.items() if k in RECOVERY_PHASES), default=0.0)


def span(inc: Incident) -> tuple[float, float]:
    """``(start, end)`` of an in-process recovery, on the clock of ``inc.detected_at`` (the
    failure's catch: the coordinator moves a node's incidents onto its own clock)."""
    phases = inc.detail.get("phases")
    return inc.detected_at, inc.detected_at + seconds(phases if isinstance(phases, Mapping) else {})


HANDLED_WITHIN_SECONDS = 30.0
"""An in-process recovery this long before an exclusion (a dead node's survivors regroup at
once; the coordinator calls the node dead seconds later) or any time after it answers it."""


def handled_at(node: str, decided_at: float, incidents: Iterable[Incident]) -> float | None:
    """When the job trained again after excluding ``node`` at ``decided_at`` without a torchrun
    restart: the end of an in-process recovery that left ``node`` out, else None."""
    ends = [span(i)[1] for i in incidents
            if is_in_process(i) and i.detail.get("ok") and node in (i.detail.get("dropped_nodes") or ())
            and i.detected_at >= decided_at - HANDLED_WITHIN_SECONDS
            and "first_step" in (i.detail.get("phases") or {})]
    return min(ends) if ends else None


class RecoveryLog:
    """A node agent's in-process recoveries: its ranks' reports, one incident per recovery.

    ``counts`` holds the recoveries recorded so far by outcome (``ok``, ``failed``), for
    ``rankwatch_in_process_recoveries_total``.
    """

    def __init__(self, node_id: str, incidents: IncidentLog) -> None:
        self.node_id = node_id
        self.incidents = incidents
        self.counts = {"ok": 0, "failed": 0}
        self.reports = 0
        """Ranks' reports taken so far, each recovery's repeats included."""
        self._recent: deque[Incident] = deque(maxlen=_KEPT)
        self._lock = threading.Lock()

    def record(self, rank: int, rec: pb.RecoveryRecord) -> Incident | None:
        """Take one rank's (validated) report; the new incident, or None if it was known."""
        probe = Incident(id="", kind="restart", node=self.node_id, rank=rank, step=rec.step,
                         detected_at=rec.started_at, detail=detail(rec))
        with self._lock:   # one incident however many ranks report at once
            self.reports += 1
            if any(same(probe, known) for known in self._recent):
                return None
            inc = self.incidents.add(kind=probe.kind, node=probe.node, rank=rank, step=rec.step,
                                     detected_at=probe.detected_at, detail=probe.detail)
            self._recent.append(inc)
            self.counts["ok" if rec.ok else "failed"] += 1
        return inc
