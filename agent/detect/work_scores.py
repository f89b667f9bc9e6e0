"""Straggler scores: each rank's own work against the others' at the same steps, the
cause of its excess, and what it costs the job (:func:`score`, :func:`cost_ratio`).

Pure functions of the ranks' recent steps and a :class:`StragglerConfig`; when a score becomes
a flag is :mod:`.straggler`'s (onset, hysteresis, node scope).  The method is described there.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from rankwatch.agent.detect.attribution import cause_of
from rankwatch.agent.detect.step_window import (
    RankWork, StepWindow, last_steps, loo_median, peer_median, recent_window, tail_medians,
)
from rankwatch.knobs import require_positive

__all__ = ["CAUSES", "GpuThrottle", "RankWork", "Score", "StragglerConfig", "cost_ratio", "eligible",
           "last_steps", "log_ratios", "loo_median", "recent_window", "role_of", "score", "score_window"]

CAUSES = ("compute", "data", "communication", "host", "gpu_health", "expert_load")


@dataclass(kw_only=True)
class StragglerConfig:
    window: int = 16
    """Steps per rank in each slowdown estimate (and each cause attribution)."""
    warmup_steps: int = 30
    """Steps a rank must complete before it is scored: a job's first steps are uneven
    (allocator, caches, connections) on every rank, and flagged there as noise."""
    threshold: float = 0.08
    """A rank is flagged only while its slowdown is at least 1 + threshold."""
    clear_threshold: float = 0.03
    """A flagged rank is cleared after ``clear_after`` steps below 1 + clear_threshold."""
    evidence: float = 2.0
    """CUSUM level (sum of log ratios above ``drift``) that confirms an onset."""
    host_evidence: float = 6.0
    """CUSUM level for a slowdown caused by CPU starvation (``host``): contention on a
    shared host comes and goes, so it must last longer before it is called a straggler."""
    drift: float = 0.05
    """Per-step log ratio that ordinary noise is not expected to exceed for long."""
    clip: float = 0.3
    """Each step's log ratio counts at most this much, either way."""
    clear_after: int = 40
    """Steps below the clear threshold before a flag is lifted."""
    node_grace: int = 8
    """Steps a flagged rank waits for its node's other ranks before it is reported alone."""
    cause_share: float = 0.5
    """A cause needs at least this share of the excess (data wait, run delay, late start)."""
    hot_expert: float = 1.5
    """A mixture of experts is uneven by nature: a rank slowed by its experts' tokens is an
    ``expert_load`` straggler only once it gets at least this many times the tokens of its
    role's others (a hot expert); a milder skew shows in the experts' finding alone."""
    min_excess_seconds: float = 0.002
    """A rank is flagged only while its excess is at least this (seconds per step): below it,
    a ratio over a short step is the host's scheduling noise (a 5 ms step on a shared CPU
    starts 1 ms late now and then, 20 %), not a rank that holds the job up."""
    hold_seconds: float = 2.0
    """Once confirmed, a slowdown must last this long in step time (start to start) before it
    is flagged: with millisecond steps the step-count evidence is over in tens of
    milliseconds, within one burst of another process on the rank's core.  Two seconds: four
    ranks sharing two cores made one of them 19 % slower for over a quarter of a second in a
    run with no straggler, and 12 % slower for over a second in 2 of 60 clean runs (a busy
    hyperthread sibling shows as compute, not as run delay); a straggler worth acting on
    costs the job far more than two seconds."""

    def __post_init__(self) -> None:
        if self.window < 3:
            raise ValueError("StragglerConfig.window must be at least 3")
        if not 0 < self.clear_threshold <= self.threshold:
            raise ValueError("StragglerConfig needs 0 < clear_threshold <= threshold")
        require_positive(self, "evidence", "drift", "clip")
        if self.host_evidence < self.evidence:
            raise ValueError("StragglerConfig.host_evidence must be at least evidence")
        if self.clear_after < 1 or self.warmup_steps < 0 or self.node_grace < 0:
            raise ValueError("StragglerConfig.clear_after must be >= 1, warmup_steps and "
                             "node_grace >= 0")
        if self.min_excess_seconds < 0 or self.hold_seconds < 0:
            raise ValueError("StragglerConfig.min_excess_seconds and hold_seconds must be >= 0")
        if not 0 < self.cause_share <= 1:
            raise ValueError("StragglerConfig.cause_share must be in (0, 1]")


def role_of(mesh_coords: Mapping[str, int] | None) -> int:
    """A rank's role from its mesh coordinates: its pipeline stage (``pp``), else 0."""
    return int((mesh_coords or {}).get("pp", 0))


@dataclass(kw_only=True)
class Score:
    rank: int
    node: str
    slowdown: float                       # own work over the others' median, window median
    cause: str
    excess_seconds: float                 # per step, over the others' median
    speedup: float                        # job step time / step time without this excess
    evidence: float = 0.0                 # the rank's CUSUM
    tokens: float = math.nan              # its experts' tokens over its role's others' median


GpuThrottle = Callable[[int], list[str]]


def _effective(w: StepWindow) -> np.ndarray:
    """Own work plus how late the rank held the others up: its step's late start after the
    others' (where starts are known: a rank that leaves its collectives late), or its late
    arrival at its collectives (where the node lined them up), whichever is more.  (Its
    wait below the others' swings step to step: it counts in :func:`score_window` only.)"""
    late = np.nan_to_num(w.late, nan=0.0)
    if not np.isfinite(w.start).any():
        return w.own + late
    lag = np.nan_to_num(w.start - peer_median(w.start, w.roles), nan=0.0)
    return w.own + np.maximum(np.maximum(lag, 0.0), late)


def log_ratios(w: StepWindow, clip: float) -> np.ndarray:
    """Per step, each rank's effective work over the median of the others' effective work
    (log, clipped to ``±clip``; NaN where unknown): the CUSUM's and the onset's terms.

    Both sides carry the late start.  Steps need not start together: with TP and FSDP no
    collective spans the step boundary (each rank runs its optimizer alone after its last
    reduce-scatter), so every rank starts a millisecond or so after some others, now and
    then.  Added to one side only, that jitter made every rank look 5-20 % slower than the
    others on millisecond steps, above the CUSUM's drift, and any burst was confirmed."""
    eff = _effective(w)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.clip(np.log(eff / peer_median(eff, w.roles)), -clip, clip)


def eligible(ranks: list[RankWork], cfg: StragglerConfig, last: int) -> list[RankWork]:
    return [r for r in ranks if r.completed >= cfg.warmup_steps + cfg.window
            and len(r.own) - (r.completed - last) >= cfg.window]


def score(ranks: list[RankWork], cfg: StragglerConfig, gpu_throttle: GpuThrottle | None = None,
          spans: dict[int, int] | None = None) -> list[Score]:
    """Scores over the last ``window`` steps that every scored rank has (needs 2+ ranks).

    ``spans`` narrows a rank's estimate to its last N steps (at least 3): the
    detector passes the steps since a rank's onset, so that a slowdown caught
    early is not diluted by the steps before it.
    """
    if not ranks:
        return []
    last = min(r.completed for r in ranks)
    full = eligible(ranks, cfg, last)
    if len(full) < 2:
        return []
    return score_window(full, recent_window(full, last, cfg.window), cfg, gpu_throttle, spans)


def score_window(full: list[RankWork], w: StepWindow, cfg: StragglerConfig, gpu_throttle: GpuThrottle | None = None,
                 spans: dict[int, int] | None = None, rows: Sequence[int] | None = None) -> list[Score]:
    """:func:`score` over a window already built (its last ``cfg.window`` steps are used).

    ``rows`` (indices into ``full``) scores only those ranks, each still against every
    rank's steps: their scores are the same as in a call that scores everyone."""
    w = last_steps(w, cfg.window)
    idx = np.arange(len(full)) if rows is None else np.asarray(rows, dtype=np.intp)
    nothing = np.full(len(idx), np.nan)

    def excess(x: np.ndarray) -> np.ndarray:
        return tail_medians((x - peer_median(x, w.roles))[idx], k) if np.isfinite(x).any() else nothing

    k = np.array([min(cfg.window, max(3, (spans or {}).get(full[i].rank, cfg.window))) for i in idx], dtype=int)
    own_all = w.own
    base_all = peer_median(own_all, w.roles)
    own_w, base = own_all[idx], base_all[idx]
    with np.errstate(divide="ignore", invalid="ignore"):
        slowdown = tail_medians(own_w / base, k)
    own, base_k = tail_medians(own_w, k), tail_medians(base, k)
    own_excess = tail_medians(own_w - base, k)
    data_excess, delay_excess, lag = excess(w.data), excess(w.delay), excess(w.start)
    gap_excess, comm_delay_excess = excess(w.gap), excess(w.comm_delay)
    late = excess(w.late)   # arriving late at collectives; without stages, also the others' longer wait:
    if w.roles is None:     # (with stages a rank's waits are its receives, which its replicas do not share)
        late = np.fmax(late, -excess(w.wait))
    load = _expert_load(full, w.roles)
    out = []
    for j, i in enumerate(idx.tolist()):
        r = full[i]
        if not np.isfinite(slowdown[j]) or not base_k[j] > 0:
            continue
        lag_j = max(float(lag[j]), 0.0) if np.isfinite(lag[j]) else 0.0
        late_j = max(float(late[j]), 0.0) if np.isfinite(late[j]) else 0.0   # the others' wait for it
        extra = max(float(own_excess[j]) + lag_j, late_j)
        cause = cause_of(extra, lag_j, float(data_excess[j]), float(delay_excess[j]),
                       gpu_throttle(r.rank) if gpu_throttle else [], cfg, outside=float(gap_excess[j]))
        ratio = float(slowdown[j])
        if late_j > max(float(own_excess[j]) + lag_j, 0.0):   # held the others up more than its own work shows
            ratio = max(ratio, (float(base_k[j]) + late_j) / float(base_k[j]))
        if cause in ("compute", "host") and load[i] - 1 >= cfg.cause_share * (ratio - 1) > 0:
            cause = "expert_load"   # its experts got the tokens that make up its extra work
        if lag_j > 0 and cause in ("communication", "data"):
            ratio = (float(own[j]) + lag_j) / float(base_k[j])
        if cause == "host":
            extra, ratio = _starved(extra, ratio, float(comm_delay_excess[j]), r.step_seconds, float(base_k[j]))
        out.append(Score(rank=r.rank, node=r.node, slowdown=ratio, cause=cause, excess_seconds=extra,
                         speedup=_speedup(r.step_seconds or float(own[j]), extra, float(base_k[j])),
                         tokens=float(load[i])))
    return out


def _expert_load(full: list[RankWork], roles: np.ndarray | None) -> np.ndarray:
    """Each rank's expert tokens per step over the median of its role's others (NaN: unknown).

    A rank whose experts received k times the others' tokens does about k times their expert
    compute; :func:`score_window` names ``expert_load`` when that share explains at least
    ``cause_share`` of its excess (own work over the others')."""
    tokens = np.array([[r.tokens] for r in full], dtype=float)
    if not np.isfinite(tokens).any():
        return np.full(len(full), np.nan)
    with np.errstate(divide="ignore", invalid="ignore"):
        return (tokens / peer_median(tokens, roles))[:, 0]


def _starved(extra: float, ratio: float, comm_delay: float, step: float, base: float) -> tuple[float, float]:
    """A host-starved rank's excess and slowdown, counting the run delay of its collective
    threads as well as its own work's excess.

    On gloo a starved rank's collectives run on threads starved with it; the others wait
    for them inside the collective, so the job's lost time barely shows in the rank's own
    work (a rank at 3 % of a core: own work x1.5, the job's step x30).  ``comm_delay`` is
    those threads' run delay per step over the others'; the training thread's is inside
    the own work already.  Part of it can fall while the training thread computes (a
    thread that takes in a peer's early data), so the excess stops at the step less the
    others' own work.  Only a rank whose *training thread* is starved (the cause) gets
    this: a collective thread that waits beside a busy training thread is the rank's
    own compute, not its host."""
    if not math.isfinite(comm_delay) or comm_delay <= 0:
        return extra, ratio
    excess = min(extra + comm_delay, max(step - base, extra))
    return excess, max(ratio, (base + excess) / base)


def _speedup(step: float, extra: float, base: float) -> float:
    """How much faster the job would step without a rank's ``extra`` seconds a step.

    ``step`` is the rank's step time inside its step scope, which misses excess spent
    outside it (a loader fetched between steps).  The job's step without the excess is at
    least the others' own work (``base``), and with it at least that plus the excess.
    """
    extra = max(extra, 0.0)
    without = max(step - extra, base, 1e-9)
    return max(step, without + extra) / without


def cost_ratio(flagged: list[Score], step_seconds: float) -> float:
    """The job's step-time speed-up if every flagged straggler's excess were gone.

    Every rank waits for the slowest, so removing them all saves the largest excess.
    """
    excess = max((s.excess_seconds for s in flagged), default=0.0)
    if step_seconds <= 0 or excess <= 0:
        return 1.0
    return step_seconds / max(step_seconds - excess, 1e-9)
