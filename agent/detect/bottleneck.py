"""What bounds a job's steps now: input (data wait), communication (collective wait) or compute.

The straggler detector compares ranks with each other, so a slowdown every rank shares
cancels out there.  This module names what the steps of a group of ranks (a node's, or the
job's) are made of, whatever the ranks have in common.

The rule, step by step:

* **A rank's make-up** (:func:`rank_part`): over its last ``window`` steps (at least
  ``min_steps``; fewer and the rank is left out), the medians per step of its step time
  (own work plus collective wait), its data wait, its collective wait and its own work.
  Medians, so a checkpoint step or an eval pass does not move it.
* **The critical ranks** (:func:`combine`): in synchronous training every rank's step
  takes as long as the slowest rank's, and a rank's collective wait includes the time it
  waited for slower peers.  That time is not communication: it is the slower ranks' own
  work.  So the job's step is read off the ranks that work the most (own work within
  ``tolerance`` of the most any rank does, the critical path); their collective wait is
  what communication itself costs (even they wait that long), and their data wait and
  compute are what the other ranks wait for.  The make-up of a group is the mean of its
  critical ranks' (each weighted by the ranks it stands for), so a node sends one
  make-up for its ranks and the coordinator combines the nodes' the same way.  With every
  rank alike, every rank is critical; with one data straggler, the job's step is that
  rank's, and the job is input-bound because of it (the straggler incident names it).
* **The shares**: ``input`` = data wait over the step, ``communication`` = collective wait
  over the step, ``compute`` = the rest (forward, backward, optimizer and host time), each
  0 to 1 and summing to 1.
* **The kind** (:func:`decide`): the kind with the largest share.  Hysteresis: a named
  kind stays until another leads it by ``margin`` for ``hold_seconds`` without a break,
  so a job near the line between two kinds does not flap.  No group with enough steps
  (no rank connected, or a restart's new workers) clears it: null until enough steps.

The GPU utilisation (NVML, where there is a GPU) rides along, not in the rule: a low
utilisation beside an ``input`` or ``communication`` verdict is the accelerator idling.
Pure functions of (now, state, config); :class:`BottleneckWatch` only keeps the state.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["KINDS", "BottleneckConfig", "BottleneckState", "BottleneckWatch", "Part", "Verdict",
           "combine", "decide", "rank_part", "shares_of"]

KINDS = ("input", "communication", "compute")


@dataclass(frozen=True)
class BottleneckConfig:
    window: int = 32              # a rank's recent steps the medians are over
    min_steps: int = 10           # fewer recent steps and a rank is left out
    tolerance: float = 0.10       # own work within this of the most is on the critical path
    margin: float = 0.05          # another kind's share must lead by this much ...
    hold_seconds: float = 3.0     # ... for this long before it is named

    def __post_init__(self) -> None:
        if not (self.window >= 1 and 1 <= self.min_steps and 0.0 <= self.tolerance < 1.0
                and 0.0 <= self.margin < 1.0 and self.hold_seconds >= 0.0):
            raise ValueError(f"BottleneckConfig out of range: {self}")


@dataclass(frozen=True)
class Part:
    """Per-step medians (seconds) of one rank, or the mean of a group's critical ranks."""

    step: float                   # own work plus collective wait
    data: float
    wait: float
    own: float
    ranks: int = 1                # the critical ranks it is the mean of
    seen: int = 1                 # the ranks with enough recent steps it stands for
    steps: int = 0                # the fewest recent steps among them
    gpu_utilization: float | None = None


@dataclass(frozen=True)
class Verdict:
    kind: str
    share: float
    shares: dict[str, float]
    since: float                  # when ``kind`` was named (the caller's clock)
    part: Part


@dataclass(frozen=True)
class BottleneckState:
    verdict: Verdict | None = None
    challenger: str | None = None   # a kind that leads the named one by the margin ...
    challenger_since: float = 0.0   # ... since then


def rank_part(own: Sequence[float], data: Sequence[float], wait: Sequence[float],
              cfg: BottleneckConfig) -> Part | None:
    """A rank's make-up over its recent steps (windows oldest first, newest last); None with
    fewer than ``min_steps`` steps, or none that took any time."""
    n = min(len(own), len(data), len(wait), cfg.window)
    if n < cfg.min_steps:
        return None
    o = np.asarray(own[len(own) - n:], np.float64)
    w = np.asarray(wait[len(wait) - n:], np.float64)
    d = np.minimum(np.asarray(data[len(data) - n:], np.float64), o)   # data wait is own work
    step = float(np.median(o + w))
    if not step > 0.0:
        return None
    return Part(step=step, data=float(np.median(d)), wait=float(np.median(w)), own=float(np.median(o)),
                steps=n)


def combine(parts: Iterable[Part | None], cfg: BottleneckConfig) -> Part | None:
    """A group's make-up: the weighted mean of its critical parts (own work within
    ``tolerance`` of the most); the GPU utilisation is the mean over every part that has one."""
    ps = [p for p in parts if p is not None]
    if not ps:
        return None
    most = max(p.own for p in ps)
    crit = [p for p in ps if p.own >= (1.0 - cfg.tolerance) * most]
    weight = sum(p.ranks for p in crit)

    def mean(attr: str) -> float:
        return sum(getattr(p, attr) * p.ranks for p in crit) / weight

    gpus = [(p.gpu_utilization, p.seen) for p in ps if p.gpu_utilization is not None]
    gpu = sum(u * n for u, n in gpus) / sum(n for _, n in gpus) if gpus else None
    return Part(step=mean("step"), data=mean("data"), wait=mean("wait"), own=mean("own"), ranks=weight,
                seen=sum(p.seen for p in ps), steps=min(p.steps for p in crit), gpu_utilization=gpu)


def shares_of(p: Part) -> dict[str, float]:
    """Each kind's part of the step, 0 to 1, summing to 1 (medians need not add up: input
    and communication are scaled down together when they exceed the step)."""
    data, wait = max(0.0, p.data), max(0.0, p.wait)
    total = max(p.step, data + wait)
    if not total > 0.0:
        return {"input": 0.0, "communication": 0.0, "compute": 1.0}
    i, c = data / total, wait / total
    return {"input": i, "communication": c, "compute": max(0.0, 1.0 - i - c)}


def decide(now: float, state: BottleneckState, part: Part | None, cfg: BottleneckConfig) -> BottleneckState:
    """The next state: the kind named for ``part`` (the group's make-up now), with hysteresis."""
    if part is None:
        return BottleneckState()
    shares = shares_of(part)
    top = max(KINDS, key=lambda k: shares[k])   # (ties: the first of KINDS)
    cur = state.verdict
    if cur is None:
        return BottleneckState(Verdict(top, shares[top], shares, now, part))
    kind, since, challenger, challenger_since = cur.kind, cur.since, None, 0.0
    if top != kind and shares[top] >= shares[kind] + cfg.margin:
        challenger = top
        challenger_since = state.challenger_since if state.challenger == top else now
        if now - challenger_since >= cfg.hold_seconds:
            kind, since, challenger = top, now, None
    verdict = Verdict(kind, shares[kind], shares, since, part)
    return BottleneckState(verdict, challenger, challenger_since)


class BottleneckWatch:
    """The state between evaluations (one per node agent, one on the coordinator)."""

    def __init__(self, cfg: BottleneckConfig | None = None) -> None:
        self.cfg = cfg or BottleneckConfig()
        self.state = BottleneckState()
        self.part: Part | None = None
        """The latest make-up it was given (what a node sends its coordinator)."""

    def update(self, now: float, part: Part | None) -> Verdict | None:
        self.part = part
        self.state = decide(now, self.state, part, self.cfg)
        return self.state.verdict

    @property
    def verdict(self) -> Verdict | None:
        return self.state.verdict
