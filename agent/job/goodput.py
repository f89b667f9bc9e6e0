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
* ``recompute``: steps trained again after resuming from an older checkpoint or a peer
  snapshot (the steps retrained so far, up to the high-water mark before the resume, times
  the step time);
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

from rankwatch.agent.node import recoveries
from rankwatch.agent.durable.decisions import Decision
from rankwatch.agent.durable.incidents import Incident

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
    down_from: float | None = None
    """When the job last advanced before it went back: the workers' downtime runs from here
    to ``at``.  It counts as ``restart``, whether or not a decision caused it (a spare that
    joins restarts every worker through torchrun, with no decision)."""


@dataclass(frozen=True, kw_only=True)
class Progress:
    first_step_at: float | None = None
    high_water: int = -1
    last_top: int = -1
    """The fastest rank's step at the last sample."""
    advanced_at: float | None = None
    """When the fastest rank's step last went up."""
    workers: frozenset[int] = frozenset()
    """Worker pids seen stepping: a new one that started behind the high-water mark resumed."""
    resumes: tuple[Resume, ...] = ()


class StepProgress:
    """The job's step progress, sampled a few times a second by the agent's detector loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._progress = Progress()

    def snapshot(self) -> Progress:
        with self._lock:
            return self._progress

    def observe(self, now: float, steps: Sequence[int], step_seconds: float,
                workers: Sequence[tuple[int, int, int]] = ()) -> None:
        """The connected ranks' current steps and the job's step time; ``workers`` are their
        ``(pid, step, steps completed by this worker)``."""
        with self._lock:
            self._progress = _advance(self._progress, now, steps, step_seconds, workers)


_MAX_WORKERS = 1 << 16


def _advance(p: Progress, now: float, steps: Sequence[int], step_seconds: float,
             workers: Sequence[tuple[int, int, int]] = ()) -> Progress:
    """``p`` after one sample of the ranks' steps: the first step, a resume, retraining.

    A resume is new workers that started behind the high-water mark: with ``workers``, a
    pid not seen stepping before whose first step came after an older checkpoint; without,
    the fastest rank's step going back (a sample can miss that dip when the new workers
    pass the old top before it).  Workers that regroup in process keep their pids and go
    on from where they were: no resume; unless they went back to a peer snapshot's step (the
    same pids, the fastest rank's step going back), which is a resume they retrain from.
    """
    steps = [s for s in steps if s >= 0]  # a worker that has not stepped yet (-1) says nothing
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
    stepped = [(pid, step, done) for pid, step, done in workers if done > 0 and step >= 0]
    fresh = [(step, done) for pid, step, done in stepped if pid not in p.workers]
    if workers:
        back_to = min((step - done for step, done in fresh), default=p.high_water)
        if p.workers and 0 <= back_to < p.high_water:
            done = max(d for s, d in fresh if s - d == back_to)
            resumes += (Resume(at=max(now - done * step_seconds, p.advanced_at or now), step=back_to,
                               high_water=p.high_water, reached=top, step_seconds=step_seconds,
                               down_from=p.advanced_at),)
        elif not fresh and 0 <= top < p.last_top and top < p.high_water:
            # The same workers went back: regrouped in process from a peer snapshot, they train
            # the steps since it again.
            resumes += (Resume(at=now, step=top, high_water=p.high_water, reached=top,
                               step_seconds=step_seconds, down_from=p.advanced_at),)
    elif 0 <= top < p.last_top and top < p.high_water:
        # Ranks restarted behind the high-water mark: what they train up to it is recomputed.
        resumes += (Resume(at=now, step=top, high_water=p.high_water, reached=top,
                           step_seconds=step_seconds, down_from=p.advanced_at),)
    advanced = now if top > p.last_top else p.advanced_at
    seen = p.workers | {pid for pid, _, _ in stepped} if len(p.workers) < _MAX_WORKERS else p.workers
    return Progress(first_step_at=first, high_water=max(p.high_water, top), last_top=top,
                    advanced_at=advanced, workers=seen, resumes=resumes)


def breakdown(now: float, *, incidents: Iterable[Incident], decisions: Iterable[Decision],
              progress: Progress) -> dict[str, float] | None:
    """Seconds per kind of :data:`KINDS`, and ``elapsed``; None before the first step."""
    if progress.first_step_at is None:
        return None
    elapsed = max(now - progress.first_step_at, 1e-9)
    incidents = list(incidents)
    in_process = _union([recoveries.span(i) for i in incidents if recoveries.is_in_process(i)])
    hangs = _hang_spans(incidents)
    lost = {"hang": sum(b - a for a, b in _minus(hangs, in_process)),
            "restart": _restart(now, incidents, decisions, progress.resumes, hangs),
            "recompute": _recompute(progress.resumes), "checkpoint": _checkpoint(incidents)}
    total_lost = min(sum(lost.values()), elapsed)
    return {"productive": elapsed - total_lost, **lost, "elapsed": elapsed}


def _hang_spans(incidents: list[Incident]) -> list[tuple[float, float]]:
    """Each hang's ``(last progress, end)``, merged."""
    spans, seen = [], set()
    for inc in incidents:
        key = inc.id.split("/")[-1]
        if inc.kind == "hang" and key not in seen:
            seen.add(key)
            start = inc.detected_at - float(inc.detail.get("stalled_seconds") or 0.0)
            spans.append((start, max(inc.resolved_at or inc.detected_at, inc.detected_at)))
    return _union(spans)


def _minus(spans: Iterable[tuple[float, float]], cuts: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """``spans`` without the parts that ``cuts`` (disjoint, in order) cover."""
    out = []
    for a, b in spans:
        for c, d in cuts:
            if d <= a or c >= b:
                continue
            if c > a:
                out.append((a, c))
            a = max(a, d)
            if a >= b:
                break
        if a < b:
            out.append((a, b))
    return out


def _restart(now: float, incidents: list[Incident], decisions: Iterable[Decision],
             resumes: Iterable[Resume] = (), hangs: list[tuple[float, float]] | None = None) -> float:
    """Time under any restart, each counted once: a torchrun restart until it recovered, else
    until the next restart decision, else until now; an in-process one over its span; and the
    workers' downtime before a resume behind the high-water mark, decided or not, less what a
    hang (``hangs``) already counts."""
    starts = sorted(d.decided_at for d in decisions if d.kind == "exclude")
    spans = _minus([(r.down_from, r.at) for r in resumes if r.down_from is not None and r.down_from < r.at],
                   hangs or [])
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
