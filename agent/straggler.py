"""Straggler detection: whose own work is slowest, why, and what it costs.

In synchronous training every rank's step takes as long as the slowest
rank's, so wall step time cannot tell ranks apart.  Each rank reports, per
step, the time its training thread was blocked in collectives; the rest of
the step is its *own work* (compute, data loading, host time).  The straggler
works longest and waits least.

Decision, per evaluation over the last ``window`` steps of every rank:

* ``slowdown`` = the lower quartile of the rank's own work / the median over
  the *other* ranks of theirs (leave-one-out, so two ranks can be compared;
  the lower quartile because host contention only adds time);
* a rank is flagged once it has stayed at or above ``1 + threshold`` for
  ``confirm`` steps, and cleared once it has stayed below ``1 + clear_threshold``
  for ``clear_after`` steps (hysteresis: no flapping);
* the cause is ``data`` when most of the excess is data-loader wait, else
  ``compute``;
* the cost is the job's step-time speed-up if the straggler's excess were gone.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

__all__ = ["RankWork", "StragglerConfig", "StragglerDetector", "StragglerEvent", "score"]


@dataclass(kw_only=True)
class StragglerConfig:
    window: int = 16
    """Steps per rank in each evaluation."""
    warmup_steps: int = 30
    """Steps a rank must complete before it is scored (start-up is uneven)."""
    threshold: float = 0.08
    """Flag at slowdown >= 1 + threshold."""
    clear_threshold: float = 0.03
    """Clear below 1 + clear_threshold."""
    confirm: int = 24
    """Steps a rank must stay above the threshold before it is flagged."""
    clear_after: int = 40
    """Steps a flagged rank must stay below the clear threshold before the flag is lifted."""

    def __post_init__(self) -> None:
        if self.window < 3:
            raise ValueError("StragglerConfig.window must be at least 3")
        if not 0 < self.clear_threshold <= self.threshold:
            raise ValueError("StragglerConfig needs 0 < clear_threshold <= threshold")
        if self.confirm < 1 or self.clear_after < 1:
            raise ValueError("StragglerConfig.confirm and clear_after must be at least 1")


@dataclass(kw_only=True)
class RankWork:
    rank: int
    node: str
    step: int
    own: list[float]             # recent own work per step, oldest first
    data: list[float]
    wait: list[float]
    step_seconds: float          # median wall step time
    completed: int = 1 << 30     # steps completed so far


@dataclass(kw_only=True)
class Score:
    rank: int
    slowdown: float
    cause: str
    excess_seconds: float
    speedup: float               # job step time / step time without this excess


@dataclass(kw_only=True)
class StragglerEvent:
    kind: str                    # "flagged" or "cleared"
    score: Score
    work: RankWork


def score(ranks: list[RankWork], cfg: StragglerConfig) -> list[Score]:
    """Instantaneous scores of every rank with a full window (needs 2+ such ranks)."""
    full = [r for r in ranks if len(r.own) >= cfg.window and r.completed >= cfg.warmup_steps + cfg.window]
    if len(full) < 2:
        return []
    med = {r.rank: _low(r.own[-cfg.window:]) for r in full}
    data = {r.rank: _low(r.data[-cfg.window:]) for r in full}
    out = []
    for r in full:
        others = [med[o.rank] for o in full if o.rank != r.rank]
        base = statistics.median(others)
        if base <= 0:
            continue
        excess = med[r.rank] - base
        data_excess = data[r.rank] - statistics.median(data[o.rank] for o in full if o.rank != r.rank)
        cause = "data" if excess > 0 and data_excess >= 0.5 * excess else "compute"
        step = r.step_seconds or med[r.rank]
        speedup = step / max(step - max(excess, 0.0), 1e-9)
        out.append(Score(rank=r.rank, slowdown=med[r.rank] / base, cause=cause,
                         excess_seconds=excess, speedup=speedup))
    return out


def _low(xs: list[float]) -> float:
    """The lower quartile: contention on a shared host only ever adds time, so
    bursts inflate a median but rarely the lower quartile; a real slowdown
    raises every sample."""
    xs = sorted(xs)
    return xs[(len(xs) - 1) // 4]


@dataclass
class StragglerDetector:
    """Hysteresis over :func:`score`; one instance per agent (or coordinator)."""

    cfg: StragglerConfig = field(default_factory=StragglerConfig)
    flagged: dict[int, Score] = field(default_factory=dict)
    _above: dict[int, int] = field(default_factory=dict)
    _below: dict[int, int] = field(default_factory=dict)

    def update(self, ranks: list[RankWork], step: int) -> list[StragglerEvent]:
        """Score at the job's ``step`` (the slowest rank's completed steps)."""
        events = []
        by_rank = {r.rank: r for r in ranks}
        for s in score(ranks, self.cfg):
            # _above/_below hold the step at which the current run began.
            if s.slowdown >= 1 + self.cfg.threshold:
                self._above.setdefault(s.rank, step)
            else:
                self._above.pop(s.rank, None)
            if s.slowdown < 1 + self.cfg.clear_threshold:
                self._below.setdefault(s.rank, step)
            else:
                self._below.pop(s.rank, None)
            above = step - self._above[s.rank] if s.rank in self._above else -1
            below = step - self._below[s.rank] if s.rank in self._below else -1
            if s.rank in self.flagged:
                if below >= self.cfg.clear_after:
                    del self.flagged[s.rank]
                    events.append(StragglerEvent(kind="cleared", score=s, work=by_rank[s.rank]))
                else:
                    self.flagged[s.rank] = s
            elif above >= self.cfg.confirm:
                self.flagged[s.rank] = s
                events.append(StragglerEvent(kind="flagged", score=s, work=by_rank[s.rank]))
        return events
