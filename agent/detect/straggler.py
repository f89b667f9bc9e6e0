"""Straggler detection: whose own work is slowest, why, and what it costs.

In synchronous training every rank's step takes as long as the slowest
rank's, so wall step time cannot tell ranks apart.  Each rank reports, per
step, the time its training thread was blocked in collectives; the rest of
the step is its *own work* (compute, data loading, host time).  The straggler
works longest and waits least; the others wait for it.

Each evaluation lines the ranks' recent steps up by step number and compares,
step by step, each rank's own work with the median of the *other* ranks' own
work at the same step (leave-one-out, so two ranks can be compared, and a step
that is slow for everyone cancels out):

* ``slowdown`` = the median over the last ``window`` steps of that per-step
  ratio (robust to bursts on either side);
* onset: a one-sided CUSUM of the per-step log ratio, each term clipped to
  ``±clip`` so that one wild step weighs no more than a few ordinary ones,
  less a ``drift`` that ordinary noise does not exceed for long.  A rank is
  flagged once its CUSUM reaches ``evidence`` *and* its windowed slowdown is at
  least ``1 + threshold`` *and* its excess is at least ``min_excess_seconds`` a step
  (a few percent of a millisecond step is scheduling noise), once that has held for
  ``hold_seconds`` of step time since its onset, start to start, and stayed confirmed (a
  burst of another process is shorter);
* hysteresis: a flagged rank is cleared only after ``clear_after`` steps with
  its slowdown below ``1 + clear_threshold``; at once if it now works less than
  the others (slowdown below 1) while another flagged rank works more: the
  straggler moved, so two ranks are never both flagged at slowdowns around 1;
* a slowdown whose cause is ``host`` needs ``host_evidence``, more than the
  others: CPU contention on a shared host comes and goes;
* a whole node: when every rank of one node is flagged (and the job spans more
  than one node), one node-level event replaces the per-rank ones;
* the cause (:func:`.work_scores._cause`): ``data`` when most of the excess is data-loader
  wait, ``host`` when most of it is the training thread waiting for a CPU
  (run delay, :mod:`rankwatch.agent.node.starvation`), ``data`` again when most of it is the rank's own time between its step scopes (a loop that fetches its batch
  before ``with mon.step(n):``), ``communication`` when most of it is the rank
  leaving its collectives late (its steps start after the others' with no more
  time between its own steps), ``gpu_health`` when its GPU reports a slowdown
  throttle, else ``compute``;
* the cost: the job's step-time speed-up if the straggler's excess were gone.  A
  ``host`` straggler's excess and slowdown count its collective threads' run delay too
  (:func:`.work_scores._starved`): the job waits for them inside its collectives.

The scores (slowdown, cause, cost) are :mod:`.work_scores`'s pure functions; this module
turns them into flags over time (:class:`StragglerDetector`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from rankwatch.agent.detect.work_scores import (
    CAUSES, GpuThrottle, RankWork, Score, StragglerConfig, cost_ratio, eligible, log_ratios, recent_window, score,
    score_window,
)

__all__ = ["CAUSES", "RankWork", "Score", "StragglerConfig", "StragglerDetector", "StragglerEvent",
           "cost_ratio", "period_of", "score", "step_period"]


@dataclass(kw_only=True)
class StragglerEvent:
    """A flag raised or lifted.  ``scope`` is ``rank``, or ``node`` when every rank of
    ``work.node`` is slow: ``score`` is then the node's slowest rank and ``ranks`` all of them."""

    kind: str                             # "flagged" or "cleared"
    score: Score
    work: RankWork
    scope: str = "rank"
    ranks: list[int] = field(default_factory=list)

    def detail(self, window: int) -> dict:
        """The ``straggler`` incident's detail (``status --json`` contract: cause, slowdown)."""
        s = self.score
        return {"cause": s.cause, "slowdown": round(s.slowdown, 4), "scope": self.scope,
                "ranks": self.ranks, "excess_seconds": round(s.excess_seconds, 6),
                "cost": {"speedup_if_removed": round(s.speedup, 4),
                         "step_seconds": round(self.work.step_seconds, 6)},
                "evidence": round(s.evidence, 3), "window_steps": window}


@dataclass
class StragglerDetector:
    """Onset (CUSUM) and hysteresis over per-step scores; one instance per agent or coordinator.

    Args:
        cfg: thresholds and windows.
        gpu_throttle: ``rank -> active GPU throttle reasons`` (NVML names), if known.
    """

    cfg: StragglerConfig = field(default_factory=StragglerConfig)
    gpu_throttle: GpuThrottle | None = None
    flagged: dict[int, Score] = field(default_factory=dict)
    _cusum: dict[int, float] = field(default_factory=dict)
    _below: dict[int, int] = field(default_factory=dict)
    _ready: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Confirmed ranks -> (the step they were confirmed at, their slowdown's onset step)."""
    _last: int = 0

    def update(self, ranks: list[RankWork], step: int | None = None) -> list[StragglerEvent]:
        """Take every step completed since the last call; return flags raised or lifted.

        ``step`` is accepted for callers that pass the job's step; the ranks' own
        ``completed`` counts are what the steps are lined up by.
        """
        if not ranks:
            return []
        present = {r.rank for r in ranks}
        for gone in set(self.flagged) - present:  # a rank that left is no straggler any more
            del self.flagged[gone]
            self._below.pop(gone, None)
        last = min(r.completed for r in ranks)
        if last < self._last:
            # New workers (a restart, the next job on a long-lived agent, a rank that joined):
            # their steps count from zero, and the evidence gathered on the old counts says
            # nothing of them.  Flags stay until the new steps lift them.
            self._cusum.clear()
            self._below.clear()
            self._ready.clear()
            self._last = 0
        full = eligible(ranks, self.cfg, last)
        if last <= self._last or len(full) < 2:
            self._last = max(self._last, last)
            return []
        # Steps not yet taken, past warm-up, that every scored rank still holds.
        new = min(last - max(self._last, self.cfg.warmup_steps),
                  *(len(r.own) - (r.completed - last) for r in full))
        self._last = last
        # With a flag to keep or to confirm, one window serves the CUSUM, the onset and the
        # scores; else only the new steps are read (the common case stops after the CUSUM).
        scoring = bool(self.flagged or self._ready)
        w = recent_window(full, last, max(new, self.cfg.window) if scoring else new) if new > 0 else None
        x = log_ratios(w, self.cfg.clip) if w is not None else None
        if x is not None:
            self._accumulate(full, x[:, x.shape[1] - new:])
        if not self.flagged and max(self._cusum.values(), default=0.0) < self.cfg.evidence:
            # The common case: nothing to confirm or to clear.  No rank has the evidence, so
            # no confirmation holds on: a later burst starts its hold afresh.
            self._ready.clear()
            return []
        if w is None or w.own.shape[1] < self.cfg.window:
            w = recent_window(full, last, self.cfg.window)
            x = log_ratios(w, self.cfg.clip)
        assert x is not None
        rows = self._candidates(full)
        spans = self._spans(full, x[:, -self.cfg.window:], rows)
        slow_now = self._slow_now(full, x, rows)
        scores = {s.rank: s for s in score_window(full, w, self.cfg, self.gpu_throttle, spans, rows)}
        for s in scores.values():
            s.evidence = self._cusum.get(s.rank, 0.0)
        by_rank = {r.rank: r for r in full}
        events = self._clear(scores, by_rank, last)
        events += self._flag(scores, by_rank, ranks, last, spans, slow_now)
        events += self._superseded(scores, by_rank)
        return events

    def _candidates(self, full: list[RankWork]) -> list[int]:
        """Rows of ``full`` whose scores can change a flag: flagged or confirming ranks, ranks
        with the evidence to be confirmed, and every rank of their nodes (a node-scope flag
        needs them all).  The others' scores cannot raise or lift anything, and scoring 16,384
        ranks each evaluation costs the coordinator far more than the few that matter."""
        keen = set(self.flagged) | set(self._ready) | {
            rank for rank, c in self._cusum.items() if c >= self.cfg.evidence}
        nodes = {r.node for r in full if r.rank in keen}
        return [i for i, r in enumerate(full) if r.node in nodes]

    def _accumulate(self, full: list[RankWork], x: np.ndarray) -> None:
        """The CUSUM over each rank's new steps' log ratios (``x``: ranks by new steps)."""
        s = np.fromiter((self._cusum.get(r.rank, 0.0) for r in full), dtype=float, count=len(full))
        terms = np.nan_to_num(x, nan=0.0) - self.cfg.drift
        for j in range(terms.shape[1]):
            s = np.maximum(0.0, s + terms[:, j])
        self._cusum = dict(zip((r.rank for r in full), s.tolist()))   # ranks gone are dropped

    def _spans(self, full: list[RankWork], x: np.ndarray, rows: list[int]) -> dict[int, int]:
        """Per candidate rank with evidence, the steps since its likeliest onset inside the
        window (``x``: the window's log ratios).

        The onset is where the sum of the newest steps' log ratios, each less
        :meth:`_slow_level`, peaks: steps before a slowdown pull the sum down.
        """
        rows = [i for i in rows if self._cusum.get(full[i].rank)]
        if not rows:
            return {}
        tail = np.cumsum(np.nan_to_num(x[rows], nan=0.0)[:, ::-1] - self._slow_level(), axis=1)
        best = np.argmax(tail[:, 2:], axis=1) + 3
        return {full[i].rank: int(b) for i, b in zip(rows, best.tolist())}

    def _slow_now(self, full: list[RankWork], x: np.ndarray, rows: list[int]) -> set[int]:
        """The candidate ranks whose newest steps are still slow: the median log ratio of
        their last three steps (``x``: the window's, clipped to ``±clip``) is at least
        :meth:`_slow_level`."""
        if not rows or x.shape[1] < 3:
            return set()
        recent = np.median(np.nan_to_num(x[rows, -3:], nan=0.0), axis=1)
        return {full[i].rank for i, v in zip(rows, recent.tolist()) if v >= self._slow_level()}

    def _slow_level(self) -> float:
        """The log ratio a slow step reaches: ``log(1 + threshold)``, but at most half the clip
        (a threshold beyond the clip would make every clipped slow step read as not slow)."""
        return min(math.log1p(self.cfg.threshold), 0.5 * self.cfg.clip)

    def _clear(self, scores: dict[int, Score], by_rank: dict[int, RankWork],
               last: int) -> list[StragglerEvent]:
        events = []
        for rank in list(self.flagged):
            s = scores.get(rank)
            if s is None:
                continue
            if s.slowdown < 1 + self.cfg.clear_threshold:
                self._below.setdefault(rank, last)
            else:
                self._below.pop(rank, None)
            if rank in self._below and last - self._below[rank] >= self.cfg.clear_after:
                events.append(self._lift(rank, s, by_rank))
            else:
                self.flagged[rank] = s
        return events

    def _superseded(self, scores: dict[int, Score], by_rank: dict[int, RankWork]) -> list[StragglerEvent]:
        """Flags lifted at once: a flagged rank that now works less than the others, while
        another flagged rank works more, is not what slows the job (the straggler moved)."""
        slowest = max((scores[r].slowdown for r in self.flagged if r in scores), default=0.0)
        return [self._lift(rank, scores[rank], by_rank) for rank in list(self.flagged)
                if rank in scores and scores[rank].slowdown < min(1.0, slowest)]

    def _lift(self, rank: int, s: Score, by_rank: dict[int, RankWork]) -> StragglerEvent:
        del self.flagged[rank]
        self._below.pop(rank, None)
        self._cusum[rank] = 0.0
        return StragglerEvent(kind="cleared", score=s, work=by_rank[rank])

    def _flag(self, scores: dict[int, Score], by_rank: dict[int, RankWork], ranks: list[RankWork],
              last: int, onsets: dict[int, int], slow_now: set[int]) -> list[StragglerEvent]:
        """Raise the flags whose slowdown is confirmed and has held.

        ``onsets``: per rank, the steps since its likeliest onset (:meth:`_spans`);
        ``slow_now``: the ranks whose newest steps are still slow (:meth:`_slow_now`).  The
        hold is counted from the onset, not from the confirmation (that added the CUSUM's
        steps to every flag: 8 steps of 60 ms), and it holds only while the newest steps are
        still slow: the windowed scores stay confirmed a few steps after a burst ends, and
        those steps must not count.  A node's grace is counted from the confirmation."""
        cfg = self.cfg
        slow = {rank for rank, s in scores.items()
                if s.slowdown >= 1 + cfg.threshold and s.excess_seconds >= cfg.min_excess_seconds
                and not (s.cause == "expert_load" and s.tokens < cfg.hot_expert)}   # the routing's own skew
        # Confirmed: slow, with the evidence its cause needs now.  A rank confirmed as compute
        # whose slowdown turns out to be host (its run delay) waits for host_evidence again.
        confirmed = {rank for rank in slow - set(self.flagged) if self._cusum.get(rank, 0.0)
                     >= (cfg.host_evidence if scores[rank].cause == "host" else cfg.evidence)}
        for rank in list(self._ready):
            if rank not in confirmed:
                del self._ready[rank]
        for rank in confirmed:
            self._ready.setdefault(rank, (last, last - onsets.get(rank, 1) + 1))
        if not self._ready:
            return []
        nodes: dict[str, list[int]] = {}
        for r in ranks:
            nodes.setdefault(r.node, []).append(r.rank)
        events = []
        for node, members in sorted(nodes.items()):
            ready = sorted(r for r in members if r in self._ready)
            if not ready:
                continue
            whole = (len(nodes) > 1 and len(members) > 1
                     and all(r in self._ready or r in self.flagged for r in members))
            if whole and all(r in scores for r in members):
                events.append(self._raise([scores[r] for r in members], by_rank, "node", members))
                continue
            # Wait a little for the node's other ranks only while they are all slow too.
            waiting = len(nodes) > 1 and len(members) > 1 and all(
                r in slow or r in self.flagged for r in members)
            for rank in ready:
                since, onset = self._ready[rank]
                held = rank in slow_now and (last - onset) * step_period(by_rank[rank], cfg.window) >= cfg.hold_seconds
                if held and (not waiting or last - since >= cfg.node_grace):
                    events.append(self._raise([scores[rank]], by_rank, "rank", [rank]))
        return events

    def _raise(self, group: list[Score], by_rank: dict[int, RankWork], scope: str,
               members: list[int]) -> StragglerEvent:
        for s in group:
            self.flagged[s.rank] = s
            self._ready.pop(s.rank, None)
        worst = max(group, key=lambda s: s.slowdown)
        if scope == "node":
            causes = [s.cause for s in group]
            worst = Score(**{**worst.__dict__, "cause": max(set(causes), key=causes.count)})
        return StragglerEvent(kind="flagged", score=worst, work=by_rank[worst.rank], scope=scope,
                              ranks=sorted(members))

    def cost_ratio(self, step_seconds: float) -> float:
        """The job's speed-up if the currently flagged stragglers were gone (1 = none)."""
        return cost_ratio(list(self.flagged.values()), step_seconds)


def step_period(r: RankWork, n: int) -> float:
    """Seconds from one of the rank's step starts to the next, the median over its last ``n``:
    its step time as the job feels it, time outside the step scope included (a loader fetched
    before ``with mon.step(n):`` adds 30 ms to a 5 ms scope).  The hold is counted in it.
    Without the starts (the coordinator has none), the period the rank's node measured
    (``r.period``); without that either, ``step_seconds`` (the scope's time)."""
    if r.start is not None:
        return period_of(r.start, r.step_seconds, n)
    return max(r.period, r.step_seconds)


def period_of(starts: Sequence[float], step_seconds: float, n: int) -> float:
    """The median interval between the last ``n`` of ``starts`` (Unix times, oldest first),
    never less than ``step_seconds``; ``step_seconds`` where fewer than three are known."""
    if len(starts) >= 3:
        gaps = np.diff(np.asarray(list(starts)[-n:], dtype=float))
        gaps = gaps[np.isfinite(gaps)]
        if gaps.size:
            return max(float(np.median(gaps)), step_seconds)
    return step_seconds
