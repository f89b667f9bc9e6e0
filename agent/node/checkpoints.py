"""This node's side of checkpoints: a rank's save reports become ``checkpoint`` incidents, and
a GPU at risk asks the job for a checkpoint while it is still cheap.

When each is due is decided in :mod:`.checkpoint_due`; how the request reaches the job
(through the coordinator, or this node alone) is the agent's ``checkpoint``, passed in as ``ask``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from rankwatch.agent.wire import bounds

from rankwatch.agent.detect import checkpoint_due
from rankwatch.agent.durable.decisions import DecisionLog
from rankwatch.agent.durable.incidents import IncidentLog
from rankwatch.agent.node.intake import RankState
from rankwatch.agent.wire.ranges import clean_text
from rankwatch.proto import pb

__all__ = ["NodeCheckpoints"]

log = logging.getLogger(__name__)


class NodeCheckpoints:
    """Args:
        node: this node's id.
        incidents: where ``checkpoint`` incidents go.
        decisions: the job's decisions, to name the request a save answered.
        done: told the id of a request a rank has answered (its command need not reach later ranks).
        ask: asks the job for a checkpoint, with a reason.
    """

    def __init__(self, node: str, incidents: IncidentLog, decisions: DecisionLog, done: Callable[[str], None],
                 ask: Callable[[str], pb.CheckpointReply]) -> None:
        self._node = node
        self._incidents = incidents
        self._decisions = decisions
        self._done = done
        self._ask = ask
        self._lock = threading.Lock()
        self._steps = bounds.RecentSet(4096)   # (step, ok) keys already recorded
        self._risk_requested: dict[tuple[int, str], float] = {}
        self.pending_risk: str | None = None
        """A GPU risk's checkpoint that found nothing to save yet: asked again once ranks train."""

    def recorded(self, rank: RankState, records: Any) -> None:
        """A rank finished (or failed) a save: one ``checkpoint`` incident per step and node."""
        for rec in records:
            if rec.request_id:
                self._done(rec.request_id)
            key = rec.step if rec.ok else -rec.step - 1
            with self._lock:
                if key in self._steps:
                    continue
                self._steps.add(key)
            decision = self._decisions.get(rec.request_id) if rec.request_id else None
            reason = decision.reason if decision is not None else "periodic"
            complete_after = max(rec.completed_after, rec.duration)
            detail = {"step": rec.step, "ok": rec.ok, "seconds": round(rec.duration, 6),
                      "complete_seconds": round(complete_after, 6), "asynchronous": rec.asynchronous,
                      "path": clean_text(rec.path), "request": rec.request_id or None, "reason": reason,
                      "started_at": rec.started_at}
            if not rec.ok:
                detail["error"] = clean_text(rec.error)
            self._incidents.add(kind="checkpoint", node=self._node, rank=rank.rank, step=rec.step,
                                detected_at=rec.started_at + complete_after, detail=detail)
            (log.info if rec.ok else log.warning)(
                "checkpoint at step %d %s (training thread %.3fs, complete after %.2fs, %s)", rec.step,
                "saved" if rec.ok else "FAILED", rec.duration, complete_after, reason)

    def on_gpu_event(self, event: Any) -> None:
        """A GPU risk (rising ECC, a pending row remap, throttling): checkpoint while it is cheap.

        Fatal faults need nothing here: they are ``gpu_fault`` incidents, which reach the
        coordinator in this node's summary, and its policy excludes the node.
        """
        if event.kind != "risk":
            return
        key = (event.gpu, event.reason)
        if not checkpoint_due.risk_due(event.at, self._risk_requested.get(key)):
            return
        self._risk_requested[key] = event.at
        self.ask_for_risk(f"gpu risk: {event.reason} on gpu {event.gpu} of {event.node}")

    def ask_for_risk(self, reason: str) -> None:
        reply = self._ask(reason)
        # Before the job's first step there is nothing to save yet: ask again once it trains.
        self.pending_risk = reason if not reply.accepted and "no rank" in reply.message else None
        log.warning("%s: checkpoint %s", reason, f"at step {reply.step}" if reply.accepted
                    else f"not taken yet ({reply.message})")
