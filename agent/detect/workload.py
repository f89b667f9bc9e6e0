"""Workload imbalance: the slowest rank of a role changes from step to step.

Sequence lengths and batch content differ between data-parallel replicas, so each step one
replica computes longer and the others wait for it; the next step it is another.  No rank is
slow, so it is never a straggler (:mod:`.straggler` compares each rank's steps over a window,
where a moving slowest rank cancels out), but the job pays for it every step.  This module
names it and what it costs.

For each role (pipeline stage, or the whole job without stages) with at least two ranks, per
step: the slowest rank's own work less the role's median is the step's *excess* (what the
others waited for, at most).  The role's ``share`` is the excess summed over steps over the
steps' time summed.  A finding needs the share to reach ``min_share`` and the slowest rank to
move: no rank is the slowest in more than ``max_same`` of the steps (a rank that is always
the slowest is a straggler's business).  The role with the largest share is reported.

Pure function of the ranks' own work per step and the steps' times.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["WorkloadConfig", "workload_imbalance"]


@dataclass(frozen=True)
class WorkloadConfig:
    min_share: float = 0.03       # of the step time, lost to the moving slowest rank
    max_same: float = 0.5         # the most steps one rank may be the slowest in
    min_steps: int = 10

    def __post_init__(self) -> None:
        if not (0 < self.min_share < 1 and 0 < self.max_same <= 1 and self.min_steps >= 2):
            raise ValueError(f"WorkloadConfig out of range: {self}")


def workload_imbalance(own: np.ndarray, roles: np.ndarray, ranks: np.ndarray, step_seconds: np.ndarray,
                       cfg: WorkloadConfig = WorkloadConfig()) -> dict | None:
    """``own``: (ranks, steps) own work (NaN: unknown); ``roles``, ``ranks``: (ranks,);
    ``step_seconds``: (steps,) each step's time.  None: no finding."""
    best: dict | None = None
    for role in np.unique(roles).tolist():
        rows = np.flatnonzero(roles == role)
        x = own[rows]
        steps = np.isfinite(x).all(axis=0) & np.isfinite(step_seconds) & (step_seconds > 0)
        if len(rows) < 2 or steps.sum() < cfg.min_steps:
            continue
        x = x[:, steps]
        excess = x.max(axis=0) - np.median(x, axis=0)
        share = float(excess.sum() / step_seconds[steps].sum())
        slowest = ranks[rows][np.argmax(x, axis=0)]
        values, counts = np.unique(slowest, return_counts=True)
        same = float(counts.max() / len(slowest))
        if share < cfg.min_share or same > cfg.max_same or (best is not None and share <= best["share"]):
            continue
        top = np.argsort(-counts)[:5]
        best = {"share": round(share, 4), "role": int(role), "ranks": len(rows), "steps": int(steps.sum()),
                "distinct_slowest": int(len(values)), "most_often_slowest": round(same, 4),
                "slowest": [{"rank": int(values[i]), "steps": int(counts[i])} for i in top],
                "excess_seconds": round(float(np.median(excess)), 6),
                "text": (f"the slowest rank changes from step to step ({len(values)} ranks, none in more than "
                         f"{100 * same:.0f}% of steps): waiting for it costs {100 * share:.1f}% of the step time"
                         + (f" in stage {role}" if role else ""))}
    return best
