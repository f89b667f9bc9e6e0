"""The coordinator's open job hang: when a look at every rank is due, and what a verdict or an end records.

What a hang is, and who is its culprit, is decided by
:func:`~rankwatch.agent.detect.evaluate.evaluate` (the same function on every node); how an
open one ends by :func:`~rankwatch.agent.detect.hang_end.hang_end`.  This keeps what the
coordinator remembers between its evaluations (the open incident, each rank's steps at the
verdict, when and at what cost it last looked) and records the ``hang`` incident and its
end.  What the policy does with a new hang (an exclusion) is the coordinator's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from rankwatch.agent.detect.evaluate import HangFinding, Snapshot, Verdicts, evaluate
from rankwatch.agent.detect.hang_end import end_possible, hang_end, steps_at
from rankwatch.agent.detect.hang_verdict import HangConfig, hang_possible
from rankwatch.agent.durable.incidents import Incident, IncidentLog
from rankwatch.agent.job import pacing
from rankwatch.agent.job.global_view import JobView
from rankwatch.agent.job.loadmeter import LoadMeter

__all__ = ["HangWatch"]

log = logging.getLogger(__name__)


class HangWatch:
    """Args:
        view: the job as the coordinator knows it (its ranks' progress, what changed, exclusions).
        incidents: where a job hang is recorded and resolved.
        hang: the hang detector's settings.
        load: the coordinator's load meter (its sync interval, its quiet period, the pacing knobs).
        monotonic: the clock a pass's cost is measured on.
        on_incident: told of each hang opened.
    """

    def __init__(self, view: JobView, incidents: IncidentLog, hang: HangConfig, load: LoadMeter,
                 monotonic: Callable[[], float], on_incident: Callable[[Incident], None]) -> None:
        self.view = view
        self.incidents = incidents
        self.hang = hang
        self.load = load
        self._monotonic = monotonic
        self._on_incident = on_incident
        self.open: str | None = None   # the open job hang incident's id
        self._steps: dict[tuple[str, int], int] = {}   # each rank's completed steps at the verdict
        self._checked = float("-inf")   # when an open hang was last checked for its end
        self._pass = (float("-inf"), 0.0)   # the hang detector's last pass: (began, took), monotonic
        self._seen: tuple[int, int, int] | None = None   # _changes() at the last look at an open hang

    def look(self, now: float, snapshot: Callable[[float], Snapshot], *, restarting: bool,
             quiet_nodes: int) -> tuple[Incident, HangFinding] | None:
        """Look at every rank once, when it is worth it (:meth:`due`); record a new job hang, or
        the open one's end.  Returns the hang it opened (for the policy to act on), else None.

        Args:
            snapshot: every included rank now (the coordinator's :meth:`JobView.snapshot`).
            restarting: an exclusion's restart is under way (its workers are stopped, as a hang
                would look): no hang is opened or ended meanwhile, and no pass runs at all.
            quiet_nodes: nodes silent at this evaluation (their ranks no longer stream).
        """
        hang_due = self.due(now, restarting, quiet_nodes)
        began, took = self._pass
        verdicts, seen = None, self._changes(quiet_nodes)   # (as of the snapshot)
        if hang_due and pacing.detector_due(self._monotonic(), began, took, self.load.cfg):
            began = self._monotonic()
            verdicts = evaluate(now, snapshot(now), self.hang)
            self._pass = (began, self._monotonic() - began)
        if verdicts is not None and self._evidence(now, verdicts):
            self._checked = now
            return self._check(now, verdicts, seen)
        return None

    def due(self, now: float, restarting: bool, quiet_nodes: int) -> bool:
        """Whether a look at every rank may find anything new at ``now``.

        Snapshotting every rank is the costly part at thousands of ranks: only while a hang is
        possible at all (:func:`hang_possible`).  An open hang is checked for its end once per
        interval, and only once something that can end it changed (:func:`end_possible`).
        While an exclusion's restart is under way, never (at 16,384 ranks a discarded pass a
        third of the time, for up to ``restart_quiet_seconds``, slowed the syncs' calls).  The
        pass's own cost spaces it further (:func:`pacing.detector_due`, in :meth:`look`).
        """
        if restarting:
            return False
        if self.open is None:
            return hang_possible(now, self.view.latest_progress(), self.hang)
        every = max(1.0, self.load.interval)
        return (now - self._checked >= every
                and end_possible(now, self._changes(quiet_nodes), self._seen, self._checked))

    def _evidence(self, now: float, verdicts: Verdicts) -> bool:
        """Whether this evaluation may open or close a hang: summaries that arrived late
        after the coordinator's own overload are no evidence, except a new verdict the ranks'
        own reports show (:func:`pacing.hang_shown_by_reports`)."""
        if now >= self.load.quiet:
            return True
        found = verdicts.hang
        if self.open is not None or found is None:
            return False
        v = found.verdict
        return pacing.hang_shown_by_reports(now, self.load.quiet, v.reported_for, v.allowance, v.by_silence)

    def _changes(self, quiet_nodes: int) -> tuple[int, int, int]:
        """What alone can end an open hang, counted (:func:`end_possible`)."""
        return self.view.moves, len(self.view.excluded), quiet_nodes

    def _check(self, now: float, verdicts: Verdicts,
               seen: tuple[int, int, int]) -> tuple[Incident, HangFinding] | None:
        """``seen``: :meth:`_changes` when the verdicts' snapshot was taken."""
        ranks = verdicts.snapshot.ranks
        if self.open is not None:
            end = hang_end(ranks, self._steps)
            self._seen = seen
            if end is not None:
                log.info("job progress resumed after %s" if end == "resumed" else
                         "the job's ranks ended while %s was open", self.open)
                self.incidents.resolve(self.open, now, outcome=end)
                self.open = None
                self._seen = None
            return None
        found = verdicts.hang
        if found is None:
            return None
        hang = self.incidents.add(kind="hang", node=found.node, rank=found.rank, step=found.step,
                                  detected_at=now, detail=found.detail)
        self.open = hang.id
        self._steps = steps_at(ranks)
        self._seen = seen
        self._on_incident(hang)
        v = found.verdict
        log.warning("JOB HANG: rank %d on node %s %s; others wait in %s%s", found.rank, found.node,
                    v.reason, v.collective, f" (named while overloaded: the heard ranks reported themselves "
                                            f"stalled {v.reported_for:.1f}s)" if now < self.load.quiet else "")
        return hang, found
