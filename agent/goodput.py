"""Goodput: the share of the job's wall time that trained new steps.

Elapsed time runs from the job's first step.  What was lost is split into

* ``hang``: from the last progress before a hang to its end (the restart
  decision, or progress resuming);
* ``restart``: from a restart decision until every remaining node trains again;
* ``recompute``: steps trained again after resuming from an older checkpoint
  (the step high-water mark minus the step resumed at, times the step time);
* ``checkpoint``: time the training thread spent in checkpoint saves;

and ``productive`` is the rest.  ``rankwatch_goodput_ratio`` is productive / elapsed.
"""

from __future__ import annotations

import threading

from rankwatch.agent.incidents import Incident

__all__ = ["Goodput", "KINDS"]

KINDS = ("productive", "hang", "restart", "recompute", "checkpoint")


class Goodput:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.first_step_at: float | None = None
        self.high_water = -1
        self.recompute_seconds = 0.0
        self._resume_from: int | None = None
        self._checkpoint_steps: dict[int, float] = {}

    def observe_steps(self, now: float, steps: list[int], step_seconds: float) -> None:
        """The ranks' current steps (a few times a second): tracks resumes from older steps."""
        if not steps:
            return
        top = max(steps)
        with self._lock:
            if self.first_step_at is None and top >= 1:
                self.first_step_at = now - max(step_seconds, 0.0)
            if top < self.high_water and top >= 0:
                # Ranks restarted behind the high-water mark: a resume.  What they
                # retrain up to the mark is recomputed work.
                self._resume_from = top if self._resume_from is None else min(self._resume_from, top)
            if self._resume_from is not None and top >= self.high_water:
                self.recompute_seconds += (self.high_water - self._resume_from) * step_seconds
                self._resume_from = None
            self.high_water = max(self.high_water, top)

    def observe_checkpoint(self, step: int, seconds: float) -> None:
        with self._lock:
            self._checkpoint_steps[step] = max(self._checkpoint_steps.get(step, 0.0), seconds)

    def breakdown(self, now: float, incidents: list[Incident]) -> dict[str, float] | None:
        """Seconds per kind, and ``elapsed``; None before the first step."""
        with self._lock:
            if self.first_step_at is None:
                return None
            elapsed = max(now - self.first_step_at, 1e-9)
            ckpt = sum(self._checkpoint_steps.values())
            recompute = self.recompute_seconds
        hang = restart = 0.0
        seen_hang = set()
        for inc in incidents:
            d = inc.detail
            if inc.kind == "hang" and inc.id.split("/")[-1] not in seen_hang:
                seen_hang.add(inc.id.split("/")[-1])
                end = d.get("resolved_at") or inc.detected_at
                hang += max(0.0, end - inc.detected_at) + float(d.get("stalled_seconds") or 0.0)
            elif inc.kind == "restart":
                started = float(d.get("started_at") or inc.detected_at)
                restart += float(d.get("recovered_after_seconds") or max(0.0, now - started))
        lost = {"hang": hang, "restart": restart, "recompute": recompute, "checkpoint": ckpt}
        total_lost = min(sum(lost.values()), elapsed)
        return {"productive": elapsed - total_lost, **lost, "elapsed": elapsed}

    def ratio(self, now: float, incidents: list[Incident]) -> float | None:
        b = self.breakdown(now, incidents)
        return None if b is None else b["productive"] / b["elapsed"]
