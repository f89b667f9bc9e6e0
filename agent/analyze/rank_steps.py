"""A recorded job's rank-steps as (ranks, steps) matrices: what the live detectors read per step.

From the operations of each rank-step (:class:`~.table.OpTable`):

* its span: the first operation's start to the last one's end (``start``, ``end``);
* its wait: the durations of its blocking operations (collectives and P2P), summed: the
  time it was blocked on others, as the hooks count ``comm_wait`` live;
* its data wait: its ``data`` operations, summed;
* its own work: the span less the wait, as the live agent counts it;
* its late arrival at collectives: :func:`~rankwatch.agent.detect.late_arrival.step_late`
  over the collectives that name their ``group`` and ``seq`` (every rank's start within one
  step is on one clock, so the whole job is lined up, not one node's ranks);
* its role: its pipeline stage (``pp``), else 0.

Cells a rank has no operations in are NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rankwatch.agent.analyze.table import BLOCKING, KINDS, NOT_SET, OpTable
from rankwatch.agent.detect.late_arrival import last_arrivals, step_late

__all__ = ["StepMatrix", "step_matrix"]

_BLOCKING = np.array([KINDS.index(k) for k in BLOCKING], np.int8)
_COLLECTIVE = KINDS.index("collective")
_DATA = KINDS.index("data")


@dataclass
class StepMatrix:
    ranks: np.ndarray            # (R,) rank numbers, ascending
    steps: np.ndarray            # (S,) step numbers, ascending
    start: np.ndarray            # (R, S) seconds
    end: np.ndarray
    own: np.ndarray
    wait: np.ndarray
    data: np.ndarray
    late: np.ndarray             # NaN where the trace names no collective groups
    role: np.ndarray             # (R,) pipeline stage, 0 without stages
    staged: bool                 # the trace names pipeline stages
    nodes: list[str]             # (R,) node names ("" where unknown)

    @property
    def span(self) -> np.ndarray:
        return self.end - self.start

    def chain_gap(self) -> float:
        """The longest gap between a rank's steps read as time on one clock (ten median steps, at
        least a second): a longer one is taken for a new clock origin, as the trace format allows
        from step to step, and the step is measured and replayed from its own first start."""
        spans = self.job_steps()
        spans = spans[np.isfinite(spans)]
        return max(1.0, 10.0 * float(np.median(spans))) if spans.size else 1.0

    def job_steps(self) -> np.ndarray:
        """Each step's time: the first rank's start to the last rank's end (S,)."""
        with np.errstate(invalid="ignore"):
            return np.nanmax(self.end, axis=0) - np.nanmin(self.start, axis=0)


def step_matrix(t: OpTable) -> StepMatrix:
    ranks, ri = np.unique(t.rank, return_inverse=True)
    steps, si = np.unique(t.step, return_inverse=True)
    R, S = len(ranks), len(steps)
    cell = ri.astype(np.int64) * S + si
    n = R * S
    start = np.full(n, np.inf)
    np.minimum.at(start, cell, t.start)
    end = np.full(n, -np.inf)
    np.maximum.at(end, cell, t.start + t.duration)
    count = np.bincount(cell, minlength=n)
    blocking = np.isin(t.kind, _BLOCKING)
    wait = np.bincount(cell, weights=np.where(blocking, t.duration, 0.0), minlength=n)
    data = np.bincount(cell, weights=np.where(t.kind == _DATA, t.duration, 0.0), minlength=n)
    missing = count == 0
    for a in (start, end, wait, data):
        a[missing] = np.nan
    shape = (R, S)
    first, last, blocked, loading = (a.reshape(shape) for a in (start, end, wait, data))
    own = np.maximum((last - first) - blocked, 0.0)
    pp = t.column("pp")
    role = np.zeros(R, np.int64)
    staged = pp is not None and bool((pp != NOT_SET).any())
    if staged:
        assert pp is not None
        np.maximum.at(role, ri, np.where(pp == NOT_SET, 0, pp))
    return StepMatrix(ranks=ranks, steps=steps, start=first, end=last, own=own, wait=blocked, data=loading,
                      late=_late(t, ri, si, shape), role=role, staged=staged, nodes=_nodes(t, ri, R))


def _late(t: OpTable, ri: np.ndarray, si: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    seq = t.column("seq")
    if t.group is None or seq is None:
        return np.full(shape, np.nan)
    rows = np.flatnonzero((t.kind == _COLLECTIVE) & (t.group != NOT_SET) & (seq != NOT_SET))
    if not rows.size:
        return np.full(shape, np.nan)
    g, q, s = t.group[rows].astype(np.int64), seq[rows], t.start[rows]
    late, _ = last_arrivals(g, q, s)
    per = step_late(ri[rows], si[rows], g, q, late)
    out = np.zeros(shape)
    for (r, st), v in per.items():
        out[r, st] = v
    return out


def _nodes(t: OpTable, ri: np.ndarray, R: int) -> list[str]:
    if t.node is None:
        return [""] * R
    first = np.full(R, NOT_SET, np.int64)
    first[ri[::-1]] = t.node[::-1]          # some row's node per rank
    return [t.names[i] if i >= 0 else "" for i in first.tolist()]
