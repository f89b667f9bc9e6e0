"""Goodput: the share of the job's wall time that trained new steps.

A reader: :func:`breakdown` is a pure function of the incident log, the decision log,
the job's step progress and ``now``.  Elapsed time runs from the job's first step.
What was lost is split into

* ``hang``: from the last progress before a hang to its end (the restart
  decision, or progress resuming);
* ``restart``: from a restart decision until every remaining node trains again,
  or until the next restart decision if that came first (it supersedes it); and each
  in-process recovery, from the failure's catch until its first step (or the last phase
  a failed attempt reached).  Time covered by several restarts (the nodes' reports of
  one recovery, a failed attempt and the torchrun restart that took over) counts once;
* a hang's time that an in-process recovery covers is the recovery's, not the hang's;
* ``recompute``: steps trained again after resuming from an older checkpoint (the
  steps retrained so far, up to the high-water mark before the resume, times the
  step time);
* ``checkpoint``: time the training thread spent in checkpoint saves (each saved
  step once, the longest any node reported);

and ``productive`` is the rest.  ``rankwatch_goodput_ratio`` is productive / elapsed.

:class:`StepProgress` is the one record goodput needs that no log holds: when the
job's first step completed, and each resume behind the high-water mark.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from rankwatch.agent import recoveries
from rankwatch.agent.decisions import Decision
from rankwatch.agent.incidents import Incident

__all__ = ["KINDS", "Progress", "Resume", "StepProgress", "breakdown"]

KINDS = ("productive", "hang", "restart", "recompute", "checkpoint")


@dataclass(frozen=True, kw_only=True)
class Resume:
    """The job went back to ``step`` (a checkpoint) after it had reached ``high_water``."""

    at: float
    step: int
    high_water: int
    reached: int
    """The highest step trained since the resume."""
    step_seconds: float
    """The step time seen last since the resume."""


@dataclass(frozen=True, kw_only=True)
class Progress:
    first_step_at: float | None = None
    high_water: int = -1
    last_top: int = -1
    """The fastest rank's step at the last sample."""
    resumes: tuple[Resume, ...] = ()


class StepProgress:
    """The job's step progress, sampled a few times a second by the agent's detector loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._progress = Progress()

    def snapshot(self) -> Progress:
        with self._lock:
            return self._progress

    def observe(self, now: float, steps: Sequence[int], step_seconds: float) -> None:
        """The connected ranks' current steps and the job's step time."""
        with self._lock:
            self._progress = _advance(self._progress, now, steps, step_seconds)


def _advance(p: Progress, now: float, steps: Sequence[int], step_seconds: float) -> Progress:
    """``p`` after one sample of the ranks' steps: the first step, a resume, retraining."""
    if not steps:
        return p
    top = max(steps)
    first = p.first_step_at
    if first is None and top >= 1:
        first = now - max(step_seconds, 0.0)
    resumes = p.resumes
    if resumes and resumes[-1].reached < resumes[-1].high_water:  # retraining after the last resume
        last = resumes[-1]
        resumes = resumes[:-1] + (replace(last, reached=max(last.reached, top), step_seconds=step_seconds),)
    if 0 <= top < p.last_top and top < p.high_water:
        # Ranks restarted behind the high-water mark: what they train up to it is recomputed.
        resumes += (Resume(at=now, step=top, high_water=p.high_water, reached=top,
                           step_seconds=step_seconds),)
    return Progress(first_step_at=first, high_water=max(p.high_water, top), last_top=top, resumes=resumes)


def breakdown(now: float, *, incidents: Iterable[Incident], decisions: Iterable[Decision],
              progress: Progress) -> dict[str, float] | None:
    """Seconds per kind of :data:`KINDS`, and ``elapsed``; None before the first step."""
    if progress.first_step_at is None:
        return None
    elapsed = max(now - progress.first_step_at, 1e-9)
    incidents = list(incidents)
    in_process = _union([recoveries.span(i) for i in incidents if recoveries.is_in_process(i)])
    lost = {"hang": _hang(incidents, in_process), "restart": _restart(now, incidents, decisions),
            "recompute": _recompute(progress.resumes), "checkpoint": _checkpoint(incidents)}
    total_lost = min(sum(lost.values()), elapsed)
    return {"productive": elapsed - total_lost, **lost, "elapsed": elapsed}


def _hang(incidents: list[Incident], in_process: list[tuple[float, float]]) -> float:
    """Each hang once (a node's copy of the coordinator's is ``<coordinator>/<id>``), from its
    last progress to its end, less what in-process recoveries (``in_process``, disjoint) cover."""
    out, seen = 0.0, set()
    for inc in incidents:
        key = inc.id.split("/")[-1]
        if inc.kind != "hang" or key in seen:
            continue
        seen.add(key)
        start = inc.detected_at - float(inc.detail.get("stalled_seconds") or 0.0)
        end = max(inc.resolved_at or inc.detected_at, inc.detected_at)
        out += (end - start) - sum(max(0.0, min(end, b) - max(start, a)) for a, b in in_process)
    return out


def _restart(now: float, incidents: list[Incident], decisions: Iterable[Decision]) -> float:
    """Time under any restart, each counted once: a torchrun restart until it recovered, else
    until the next restart decision, else until now; an in-process one over its span."""
    starts = sorted(d.decided_at for d in decisions if d.kind == "exclude")
    spans = []
    for inc in incidents:
        if inc.kind != "restart":
            continue
        if recoveries.is_in_process(inc):
            spans.append(recoveries.span(inc))
            continue
        started = float(inc.detail.get("started_at") or inc.detected_at)
        recovered = inc.detail.get("recovered_after_seconds")
        if recovered is None:
            end = next((t for t in starts if t > started), now)
            recovered = max(0.0, end - started)
        spans.append((started, started + float(recovered)))
    return sum(b - a for a, b in _union(spans))


def _union(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Intervals merged where they overlap: disjoint, in order."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, max(a, b)))
    return out


def _recompute(resumes: Iterable[Resume]) -> float:
    return sum(max(0, min(r.reached, r.high_water) - r.step) * r.step_seconds for r in resumes)


def _checkpoint(incidents: list[Incident]) -> float:
    by_step: dict[int, float] = {}
    for inc in incidents:
        if inc.kind == "checkpoint":
            by_step[inc.step] = max(by_step.get(inc.step, 0.0), float(inc.detail.get("seconds") or 0.0))
    return sum(by_step.values())
