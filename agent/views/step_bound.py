"""What bounds the steps, kept for the views: this node's ranks' verdict every tick, the job's
(from the nodes' make-ups) once a second while this agent coordinates, and which of them
``Status`` and ``/metrics`` show.  The verdicts are :mod:`rankwatch.agent.detect.bottleneck`'s;
this module only keeps and picks them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from rankwatch.agent.detect.bottleneck import BottleneckWatch, Part, combine
from rankwatch.agent.node import makeup
from rankwatch.proto import pb

__all__ = ["StepBound"]

JOB_EVERY_SECONDS = 1.0   # a node's make-up changes no faster than it syncs


class StepBound:
    """Args:
        coordinating: whether this agent coordinates the job now.
    """

    def __init__(self, coordinating: Callable[[], bool]) -> None:
        self._coordinating = coordinating
        self.node = BottleneckWatch()
        """What bounds this node's ranks' steps."""
        self.job = BottleneckWatch()
        """What bounds the job's, from the nodes' summaries, while this agent coordinates."""
        self._job_at = float("-inf")

    def update(self, now: float, node_part: Part | None, job_parts: Callable[[], Iterable[Part | None]]) -> bool:
        """Decide the node's verdict; the job's when one is due.  True when the job's was due
        (the caller's other once-a-second views follow it)."""
        self.node.update(now, node_part)
        coordinating = self._coordinating()
        if not coordinating:
            self.job.update(now, None)
        if now - self._job_at < JOB_EVERY_SECONDS:
            return False
        self._job_at = now
        if coordinating:
            self.job.update(now, combine(job_parts(), self.job.cfg))
        return True

    def shown(self) -> pb.Bottleneck | None:
        """The job's verdict on the coordinator, else this node's ranks' (None: not enough steps)."""
        if self._coordinating():
            v, scope = self.job.verdict, "job"
        else:
            v, scope = self.node.verdict, "node"
        return makeup.verdict_pb(v, scope) if v is not None else None

    def verdicts(self) -> list[tuple[str, Any]]:
        """(scope, verdict) for /metrics: this node's ranks', and the job's while coordinating."""
        job = [("job", self.job.verdict)] if self._coordinating() else []
        return [("node", self.node.verdict), *job]
