"""``rankwatch analyze``'s answer for one recorded job: the ``--json`` object (``docs/analyze.md``).

Every finding comes from the live agent's decisions (:mod:`.detectors`), the workload
imbalance from :mod:`rankwatch.agent.detect.workload`, the what-if cost from the replay
(:mod:`.replay`).  This module only gathers them.
"""

from __future__ import annotations

import numpy as np

from rankwatch.agent.analyze import detectors
from rankwatch.agent.analyze.replay import MAX_RANKS, replay
from rankwatch.agent.analyze.step_graph import ReplayError
from rankwatch.agent.analyze.rank_steps import StepMatrix, step_matrix
from rankwatch.agent.analyze.table import OpTable
from rankwatch.agent.detect.consequence import consequences
from rankwatch.agent.detect.straggler import StragglerConfig
from rankwatch.agent.detect.step_window import loo_median
from rankwatch.agent.detect.workload import workload_imbalance
from rankwatch.agent.views.work_spread import pipeline_pb
from rankwatch.status import pipeline_dict

__all__ = ["HEATMAP_STEPS", "analyze"]

HEATMAP_STEPS = 200
"""Steps the heatmap shows at most: longer recordings are shown in blocks of steps (each the
block's largest value)."""


def analyze(t: OpTable, cfg: StragglerConfig | None = None, whatif: bool = True) -> dict:
    sm = step_matrix(t)
    incidents = detectors.stragglers(sm, detectors.offline_config(sm, cfg))
    incidents += detectors.hang(t, sm)
    for i, inc in enumerate(incidents, start=1):
        inc["id"] = f"a{i}"
    pipe = detectors.stages(sm)
    periods = _periods(sm)
    out = {
        "source": t.source, "ranks": int(len(sm.ranks)), "steps": int(len(sm.steps)), "operations": len(t),
        "step_seconds": round(float(np.nanmedian(periods)), 6) if np.isfinite(periods).any() else None,
        "incidents": incidents,
        "pipeline": pipeline_dict(pipeline_pb(pipe, "job")) if pipe is not None else None,
        "bottleneck": detectors.bottleneck(sm),
        "workload_imbalance": workload_imbalance(sm.own, sm.role, sm.ranks, periods),
        "whatif": [], "replay": None, "dismissed": [], "heatmap": heatmap(sm),
    }
    if whatif:
        flagged = [inc["rank"] for inc in incidents if inc["kind"] == "straggler"]
        try:
            rep = replay(t, dict(zip(sm.ranks.tolist(), sm.role.tolist())), candidates(sm, flagged),
                         max_gap=sm.chain_gap())
        except ReplayError as e:
            out["replay"] = {"ok": False, "error": None, "note": f"cannot be replayed: {e}"}
            return out
        out["whatif"], out["replay"] = rep.whatif, rep.to_json()
        out["incidents"], out["dismissed"] = _vetted(incidents, rep.whatif)
    return out


def _vetted(incidents: list[dict], whatif: list[dict]) -> tuple[list[dict], list[dict]]:
    """The incidents less the stragglers the replay shows to be another's consequence
    (:mod:`rankwatch.agent.detect.consequence`), and those, each with whose."""
    gains = {int(w["what"]): w["speedup"] for w in whatif if w["kind"] == "rank"}
    of = consequences([i["rank"] for i in incidents if i["kind"] == "straggler"], gains)
    kept, dismissed = [], []
    for inc in incidents:
        if inc["kind"] == "straggler" and inc["rank"] in of:
            culprit = of[inc["rank"]]
            dismissed.append({**inc, "consequence_of": culprit,
                              "reason": f"replayed at its peers' median it gains the job {gains[inc['rank']]:.3f}x; "
                                        f"rank {culprit} gains it {gains[culprit]:.3f}x"})
        else:
            kept.append(inc)
    return kept, dismissed


def _periods(sm: StepMatrix) -> np.ndarray:
    """Each step's time as the job felt it: the last rank's end less the last rank's end of
    the step before (the first step: its own span); a step whose ranks begin before the last
    one's end (clocks that differ per step) is its span."""
    last = np.nanmax(sm.end, axis=0)
    span = sm.job_steps()
    out = span.copy()
    if len(last) > 1:
        with np.errstate(invalid="ignore"):
            gap = sm.start[:, 1:] - sm.end[:, :-1]             # each rank's time between its steps
            chained = (np.nanmin(gap, axis=0) >= -1e-9) & (np.nanmax(gap, axis=0) <= sm.chain_gap())
        diff = last[1:] - last[:-1]
        out[1:] = np.where(chained, diff, span[1:])
    return out


def candidates(sm: StepMatrix, flagged: list[int]) -> list[int]:
    """The ranks the replay sets to their peers' median: the flagged stragglers, then those whose
    own work exceeds their role's others' most (median over steps), up to ``MAX_RANKS``."""
    excess = np.full(len(sm.ranks), -np.inf)
    for role in np.unique(sm.role).tolist():
        rows = np.flatnonzero(sm.role == role)
        if len(rows) < 2:
            continue
        own = np.nan_to_num(sm.own[rows], nan=0.0)
        excess[rows] = np.median(own - loo_median(own), axis=1)
    order = [int(sm.ranks[i]) for i in np.argsort(-excess) if np.isfinite(excess[i])]
    picked = list(dict.fromkeys([*flagged, *order]))
    return picked[:max(MAX_RANKS, len(flagged))]


def heatmap(sm: StepMatrix) -> dict:
    """Each rank's late arrival per step (where the trace names collective groups), else its own
    work over its role's median; in blocks of steps beyond :data:`HEATMAP_STEPS`."""
    measure = "late_arrival"
    x = sm.late
    if np.isnan(x).all():
        measure = "own_excess"
        x = np.full(sm.own.shape, np.nan)
        for role in np.unique(sm.role).tolist():
            rows = sm.role == role
            x[rows] = sm.own[rows] - np.nanmedian(sm.own[rows], axis=0)
    x = np.nan_to_num(x, nan=0.0)
    steps = sm.steps
    if x.shape[1] > HEATMAP_STEPS:
        edges = np.linspace(0, x.shape[1], HEATMAP_STEPS + 1).astype(int)
        x = np.maximum.reduceat(x, edges[:-1], axis=1)
        steps = steps[edges[:-1]]
    return {"measure": measure, "ranks": sm.ranks.tolist(), "steps": steps.tolist(),
            "values": np.round(x, 6).tolist()}
