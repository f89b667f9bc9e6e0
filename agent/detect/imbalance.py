"""Imbalance by design: how the work falls over a pipeline's stages and over a mixture of experts.

A straggler is a rank that works longer than the ranks that should do the same work
(:mod:`~rankwatch.agent.detect.work_scores` compares a rank only with its own pipeline
stage's).  Two kinds of parallelism are uneven on purpose, and this module names how uneven,
as a finding of its own and never as a straggler:

* **Pipeline stages** (:func:`pipeline`).  A stage holding the loss head, or more layers,
  works longer every step, and the other stages idle in their receives (the schedule's
  bubbles).  Over each rank's last ``window`` steps (at least ``min_steps``; fewer and the
  rank is left out): its median own work per step (``compute``: time not blocked in a send,
  a receive or a collective) and its median step (own work plus that wait).  A stage's
  figures are the medians over its ranks; its ``bubble`` is ``1 - compute / step``, the
  share of its step it spends waiting.  The ``imbalance`` is the heaviest stage's compute
  over the lightest's, and the pipeline ``idle`` share the mean of the stages' bubbles.
  Fewer than two stages with enough steps: no finding.
* **Experts** (:func:`experts`).  The ranks holding popular experts get more tokens.  A
  rank's load is the mean of its recent steps' tokens over its local experts
  (``Monitor.expert_load``); the ``skew`` is the hottest rank's over the ranks' mean
  (1 = even, at most the number of ranks).  A skewed rank that is also slow is a straggler
  of cause ``expert_load`` (decided in :mod:`~rankwatch.agent.detect.work_scores`).

Pure functions of the ranks' windows and the config; the callers gather the windows
(:mod:`rankwatch.agent.views.work_spread`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["BalanceConfig", "ExpertSkew", "Pipeline", "Stage", "experts", "pipeline", "rank_load"]


@dataclass(frozen=True)
class BalanceConfig:
    window: int = 32              # a rank's recent steps the medians are over
    min_steps: int = 10           # fewer recent steps and a rank is left out

    def __post_init__(self) -> None:
        if not (self.window >= 1 and 1 <= self.min_steps <= self.window):
            raise ValueError(f"BalanceConfig out of range: {self}")


@dataclass(frozen=True)
class Stage:
    stage: int
    ranks: int                    # its ranks with enough recent steps
    compute: float                # median over its ranks of their median own work per step (s)
    step: float                   # median over its ranks of their median own work plus wait (s)

    @property
    def bubble(self) -> float:
        """The share of its step the stage waits (0 to 1)."""
        return min(1.0, max(0.0, 1.0 - self.compute / self.step)) if self.step > 0 else 0.0


@dataclass(frozen=True)
class Pipeline:
    stages: tuple[Stage, ...]     # by stage
    heaviest: int
    lightest: int

    def _by(self, stage: int) -> Stage:
        return next(s for s in self.stages if s.stage == stage)

    @property
    def imbalance(self) -> float:
        """The heaviest stage's compute over the lightest's (1 = even)."""
        light = self._by(self.lightest).compute
        return self._by(self.heaviest).compute / light if light > 0 else math.inf

    @property
    def idle(self) -> float:
        """The pipeline's idle share of a step: the mean of its stages' bubbles."""
        return sum(s.bubble for s in self.stages) / len(self.stages)

    def text(self) -> str:
        ratio = self.imbalance
        works = f"{ratio:.1f}x" if math.isfinite(ratio) else "while"
        return (f"stage {self.heaviest} works {works} stage {self.lightest}: "
                f"the pipeline idles {100 * self.idle:.0f}% of the step")


@dataclass(frozen=True)
class ExpertSkew:
    tokens: Mapping[int, float]   # rank: its experts' tokens per step
    hottest: int
    skew: float                   # the hottest rank's tokens over the ranks' mean (1 = even)


def rank_load(own: Sequence[float], wait: Sequence[float], cfg: BalanceConfig) -> tuple[float, float] | None:
    """A rank's (median own work, median own work plus wait) per step over its recent steps
    (windows oldest first); None with fewer than ``min_steps``."""
    n = min(len(own), len(wait), cfg.window)
    if n < cfg.min_steps:
        return None
    o = np.asarray(own[len(own) - n:], np.float64)
    w = np.asarray(wait[len(wait) - n:], np.float64)
    return float(np.median(o)), float(np.median(o + w))


def pipeline(ranks: Iterable[tuple[int, Sequence[float], Sequence[float]]], cfg: BalanceConfig) -> Pipeline | None:
    """How the work falls over the stages, from each rank's ``(stage, own, wait)`` windows;
    None with fewer than two stages that have a rank with enough steps."""
    loads: dict[int, list[tuple[float, float]]] = {}
    for stage, own, wait in ranks:
        load = rank_load(own, wait, cfg)
        if load is not None:
            loads.setdefault(stage, []).append(load)
    if len(loads) < 2:
        return None
    stages = tuple(Stage(stage=s, ranks=len(v), compute=float(np.median([c for c, _ in v])),
                         step=float(np.median([t for _, t in v]))) for s, v in sorted(loads.items()))
    heaviest = max(stages, key=lambda s: s.compute).stage
    lightest = min(stages, key=lambda s: s.compute).stage
    return Pipeline(stages=stages, heaviest=heaviest, lightest=lightest)


def experts(tokens: Mapping[int, float]) -> ExpertSkew | None:
    """How a mixture of experts' tokens fall over its ranks (``rank: tokens per step``, NaN
    for a rank that reports none); None with fewer than two reporting ranks or no token."""
    known = {r: t for r, t in tokens.items() if math.isfinite(t) and t >= 0}
    mean = sum(known.values()) / len(known) if known else 0.0
    if len(known) < 2 or not mean > 0:
        return None
    hottest = max(sorted(known), key=lambda r: known[r])
    return ExpertSkew(tokens=known, hottest=hottest, skew=known[hottest] / mean)
