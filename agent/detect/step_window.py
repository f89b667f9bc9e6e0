"""The straggler detector's inputs, lined up: each rank's recent steps (:class:`RankWork`) as
(ranks, steps) arrays of their last common steps (:class:`StepWindow`), and the per-step
medians every score compares with (:func:`peer_median`, leave-one-out, within a role).

Pure functions; the scores are :mod:`.work_scores`'s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["RankWork", "StepWindow", "last_steps", "loo_median", "peer_median", "recent_window", "tail_medians"]


@dataclass(kw_only=True)
class RankWork:
    """One rank's recent steps, oldest first; the last entry of each list is step ``completed``.

    ``delay`` (run delay of the training thread per step), ``comm_delay`` (run delay of
    the threads that run its collectives per step, :mod:`.starvation`) and ``start`` (Unix
    time each step began) may be shorter or absent; they are used where they cover the window.
    """

    rank: int
    node: str
    step: int
    own: Sequence[float]
    data: Sequence[float]
    wait: Sequence[float]
    step_seconds: float                   # median wall step time
    completed: int = 1 << 30              # steps completed so far
    delay: list[float] | None = None
    start: list[float] | None = None
    comm_delay: list[float] | None = None
    gap: list[float] | None = None        # time before each step since the previous one ended
    late: list[float] | None = None       # its late arrival at collectives per step (:mod:`.late_arrival`)
    period: float = 0.0                   # start to start, as the rank's node measured it (0: unknown)
    role: int = 0
    """Ranks are compared only with ranks of the same role: their pipeline stage (stages differ
    by design; a stage with no other rank has no peers and is not scored)."""
    tokens: float = math.nan
    """Tokens its local experts received per step, recently (a mixture of experts; NaN: none)."""


@dataclass
class StepWindow:
    """The ranks' last ``n`` common steps as (ranks, n) arrays; NaN where a column is missing."""

    own: np.ndarray
    data: np.ndarray
    delay: np.ndarray
    start: np.ndarray
    gap: np.ndarray
    comm_delay: np.ndarray
    late: np.ndarray
    wait: np.ndarray
    roles: np.ndarray | None = None
    """Each row's role (:attr:`RankWork.role`); None: one role."""


_COLUMNS = ("own", "data", "delay", "start", "gap", "comm_delay", "late", "wait")


def recent_window(ranks: list[RankWork], last: int, n: int) -> StepWindow:
    """The ranks' ``n`` steps up to step ``last``; NaN where a rank's column misses some."""
    behind = [r.completed - last for r in ranks]      # steps each rank is past ``last``
    roles = np.array([r.role for r in ranks]) if any(r.role for r in ranks) else None
    return StepWindow(**{name: _column(ranks, name, behind, n) for name in _COLUMNS}, roles=roles)


def _column(ranks: list[RankWork], name: str, behind: list[int], n: int) -> np.ndarray:
    cols = [c if (c := getattr(r, name)) is not None else () for r in ranks]
    if not any(len(c) for c in cols):   # a column no rank reports
        return np.full((len(ranks), n), np.nan)
    ends = [len(c) - b for c, b in zip(cols, behind)]   # index after step ``last``
    if ranks and min(ends) >= n:   # the common case: every rank holds the steps, one conversion
        return np.array([c[e - n:e] for c, e in zip(cols, ends)], dtype=float).reshape(len(ranks), n)
    out = np.full((len(ranks), n), np.nan)
    for i, (c, e) in enumerate(zip(cols, ends)):
        part = c[max(0, e - n):max(0, e)]
        if len(part):
            out[i, n - len(part):] = part
    return out


def last_steps(w: StepWindow, n: int) -> StepWindow:
    """The window's last ``n`` steps (a view)."""
    return StepWindow(**{name: getattr(w, name)[:, -n:] for name in _COLUMNS}, roles=w.roles)


def peer_median(x: np.ndarray, roles: np.ndarray | None) -> np.ndarray:
    """:func:`loo_median` within each role: the median of the other rows of the same role
    (NaN for a row alone in its role)."""
    if roles is None:
        return loo_median(x)
    out = np.full(x.shape, np.nan)
    for role in np.unique(roles):
        rows = np.flatnonzero(roles == role)
        if len(rows) > 1:
            out[rows] = loo_median(x[rows])
    return out


def loo_median(x: np.ndarray) -> np.ndarray:
    """Per column, the median of every *other* row's value: (ranks, steps) -> same shape."""
    n = x.shape[0] - 1
    order = np.argsort(x, axis=0)
    s = np.take_along_axis(x, order, axis=0)
    pos = np.empty_like(order)
    np.put_along_axis(pos, order, np.arange(x.shape[0])[:, None].repeat(x.shape[1], 1), axis=0)

    def kth(k: int) -> np.ndarray:
        # the k-th smallest of the others: skip the row's own sorted position
        idx = np.where(k < pos, k, k + 1)
        return np.take_along_axis(s, idx, axis=0)

    if n % 2:
        return kth(n // 2)
    return 0.5 * (kth(n // 2 - 1) + kth(n // 2))


def tail_medians(x: np.ndarray, spans: np.ndarray) -> np.ndarray:
    """Per row, the median of its last ``spans[row]`` finite values (NaN if none)."""
    out = np.full(x.shape[0], np.nan)
    for k in np.unique(spans):
        rows = np.flatnonzero(spans == k)
        block = x[rows, x.shape[1] - k:]
        finite = np.isfinite(block)
        whole = finite.all(axis=1)
        if whole.any():
            out[rows[whole]] = np.median(block[whole], axis=1)
        for i in np.flatnonzero(~whole & finite.any(axis=1)):  # rare: a column partly missing
            out[rows[i]] = np.median(block[i][finite[i]])
    return out
