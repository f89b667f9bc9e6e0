"""What-if cost by replay: each step's dependency graph (:mod:`.step_graph`) replayed with one
rank, one stage or one operation type at its peers' median durations.

A ratio of medians misjudges what a slow rank costs: pipeline dependencies hide part of it
(a stage's slack absorbs it) or amplify it (every later stage waits).  The replay propagates
it: a rank reaches each blocking operation after its previous one's end plus the operations
between, a collective ends when its last member arrives, a receive when its send is posted.

The scenarios, each a column replayed beside the others:

* **unchanged**: the measured durations.  It must reproduce each measured step time within
  :data:`TOLERANCE`; the report says so when it does not (async work the rows do not show).
* **rank** ``r``: each of its operations takes the median, over the other ranks of its role
  (pipeline stage) with the same sequence of operations that step, of the operation at the same
  position (gaps too).  The candidates are the ranks whose own work exceeds their peers' most
  (:data:`MAX_RANKS`).
* **stage** ``s``: its ranks' non-blocking work scaled to the other stages' median.
* **op** ``X`` (the :data:`MAX_OPS` names with the most time): every ``X`` takes the median
  ``X`` of its role that step (a blocking one: its median tail).

A scenario's ``speedup`` is the measured time of the steps over their replayed time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from rankwatch.agent.analyze.step_graph import ReplayError, StepGraph, build
from rankwatch.agent.analyze.table import OpTable
from rankwatch.agent.detect.step_window import loo_median

__all__ = ["MAX_OPS", "MAX_RANKS", "TOLERANCE", "Replay", "replay"]

TOLERANCE = 0.05
MAX_RANKS = 64
MAX_OPS = 8


@dataclass
class Replay:
    whatif: list[dict] = field(default_factory=list)     # {kind, what, speedup}, largest first
    error: float = 0.0                                   # the largest relative error of the unchanged replay
    median_error: float = 0.0
    steps: int = 0
    unpaired: int = 0
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.error <= TOLERANCE

    def to_json(self) -> dict:
        return {"error": round(self.error, 5), "median_error": round(self.median_error, 5), "ok": self.ok,
                "steps": self.steps, "unpaired": self.unpaired, "note": self.note}


@dataclass
class _Columns:
    kinds: list[tuple[str, int | str]]
    ranks: dict[int, int]       # rank -> column
    stages: dict[int, int]
    ops: dict[int, int]         # op name index -> column


def replay(t: OpTable, role_of: dict[int, int], candidates: list[int], max_gap: float = float("inf")) -> Replay:
    """Replay every step of ``t`` (``role_of``: rank -> role; ``candidates``: the ranks to
    replay at their peers' median; ``max_gap``: the longest time between a rank's steps read
    as one clock)."""
    names_kind = np.array([_direction(n) for n in t.names] or [0], np.int8)
    cols = _columns(t, role_of, candidates)
    order = np.lexsort((t.start, t.rank, t.step))
    bounds = np.flatnonzero(np.diff(t.step[order])) + 1
    measured, replayed, unpaired = [], [], 0
    ends: dict[int, tuple[float, np.ndarray]] = {}     # rank -> (measured end, replayed ends) of its last step
    for rows in np.split(order, bounds):
        origin = _chained(t, rows, ends, max_gap)
        try:
            g = build(t, rows, names_kind, origin)
        except ReplayError as e:
            raise ReplayError(f"step {int(t.step[rows[0]])}: {e}") from None
        seg, tail = _scenarios(t, rows, g, role_of, cols)
        begin = np.stack([ends[r][1] for r in g.ranks.tolist()]) if origin is not None else None
        out_ends = _run(g, seg, tail, begin)
        if origin is None:
            measured.append(g.measured)
            replayed.append(out_ends.max(axis=0))
        else:   # the step's time: from the ranks' last step's end to theirs
            before = np.stack([ends[r][1] for r in g.ranks.tolist()]).max(axis=0)
            measured.append(float(g.ends.max() - origin.max()))
            replayed.append(out_ends.max(axis=0) - before)
        ends.update({r: (float(e), out_ends[i]) for i, (r, e) in enumerate(zip(g.ranks.tolist(), g.ends))})
        unpaired += g.unpaired
    m, r = np.array(measured), np.array(replayed)          # (S,), (S, C)
    with np.errstate(divide="ignore", invalid="ignore"):
        err = np.abs(r[:, 0] - m) / m
        err = err[np.isfinite(err)]
        total = r.sum(axis=0)
    out = Replay(steps=len(m), unpaired=unpaired, error=float(err.max()) if err.size else 0.0,
                 median_error=float(np.median(err)) if err.size else 0.0)
    for c, (kind, what) in enumerate(cols.kinds[1:], start=1):
        if total[c] > 0:
            out.whatif.append({"kind": kind, "what": what, "speedup": round(float(m.sum() / total[c]), 4)})
    out.whatif.sort(key=lambda w: -w["speedup"])
    if not out.ok:
        out.note = (f"the unchanged replay is off the measured step times by up to {100 * out.error:.1f}% "
                    f"(more than {100 * TOLERANCE:.0f}%): the what-if figures are rough")
    if unpaired:
        out.note += (" " if out.note else "") + (f"{unpaired} blocking operations name no partner "
                                                  "(group and seq, or peer and seq): replayed as measured")
    return out


def _chained(t: OpTable, rows: np.ndarray, ends: dict[int, tuple[float, np.ndarray]],
             max_gap: float) -> np.ndarray | None:
    """Per rank of this step (ascending), its last step's measured end, where every rank had
    one and starts after it, within ``max_gap`` (one clock across the steps: a rank's next
    step waits for its last); else None, and the step is replayed from its own first start."""
    ranks, first = np.unique(t.rank[rows], return_index=True)     # rows are sorted by rank, then start
    prev = np.array([ends[r][0] if r in ends else np.nan for r in ranks.tolist()])
    gap = t.start[rows[first]] - prev
    if not np.isfinite(prev).all() or (gap < -1e-9).any() or (gap > max_gap).any():
        return None
    return prev


def _direction(name: str) -> int:
    n = name.lower()
    send, recv = "send" in n, "recv" in n
    return 1 if send and not recv else 2 if recv and not send else 0


def _columns(t: OpTable, role_of: dict[int, int], candidates: list[int]) -> _Columns:
    kinds: list[tuple[str, int | str]] = [("base", "")]
    ranks = {r: len(kinds) + i for i, r in enumerate(candidates)}
    kinds += [("rank", r) for r in candidates]
    roles = sorted(set(role_of.values()))
    stages = {s: len(kinds) + i for i, s in enumerate(roles)} if len(roles) > 1 else {}
    kinds += [("stage", s) for s in stages]
    per_op = np.bincount(t.op, weights=t.duration, minlength=len(t.names))
    top = [int(i) for i in np.argsort(-per_op)[:MAX_OPS] if per_op[i] > 0]
    ops = {o: len(kinds) + i for i, o in enumerate(top)}
    kinds += [("op", t.names[o]) for o in top]
    return _Columns(kinds=kinds, ranks=ranks, stages=stages, ops=ops)


def _scenarios(t: OpTable, rows: np.ndarray, g: StepGraph, role_of: dict[int, int],
               cols: _Columns) -> tuple[np.ndarray, np.ndarray]:
    """Each scenario's segments (n_seg, C) and slot tails (m, C) for one step."""
    C = len(cols.kinds)
    work = np.where(g.blocking, 0.0, g.dur)
    base = np.bincount(g.seg_of, weights=g.gap + work, minlength=g.n_seg)
    seg = np.repeat(base[:, None], C, axis=1)
    tail = np.repeat(g.tail[:, None], C, axis=1)
    row_role = np.array([role_of.get(int(r), 0) for r in g.ranks])[g.rank_of_row]
    if cols.ranks:
        alt = _peer_rows(t, rows, g, row_role)
        alt_seg = np.bincount(g.seg_of, weights=np.where(np.isnan(alt), g.gap + work, alt), minlength=g.n_seg)
        for ri, r in enumerate(g.ranks.tolist()):
            c = cols.ranks.get(r)
            mine = g.rank_of_row == ri
            if c is not None and not np.isnan(alt[mine]).all():
                segs = np.unique(g.seg_of[mine])
                seg[segs, c] = alt_seg[segs]
    for stage, c in cols.stages.items():
        factor = _stage_factor(g, work, row_role, stage)
        if factor is not None:
            mine = row_role == stage
            scaled = np.bincount(g.seg_of[mine], weights=(g.gap + work * factor)[mine], minlength=g.n_seg)
            segs = np.unique(g.seg_of[mine])
            seg[segs, c] = scaled[segs]
    ops = t.op[rows]
    for o, c in cols.ops.items():
        _op_median(g, ops == o, row_role, work, seg, tail, c)
    return seg, tail


def _peer_rows(t: OpTable, rows: np.ndarray, g: StepGraph, row_role: np.ndarray) -> np.ndarray:
    """Per row, the median over the other ranks of its role with the same operations this step
    of the row at the same position (gap plus work; a slot: its gap); NaN without such peers."""
    alt = np.full(len(rows), np.nan)
    contrib = g.gap + np.where(g.blocking, 0.0, g.dur)
    bounds = np.flatnonzero(np.diff(g.rank_of_row)) + 1
    spans = np.split(np.arange(len(rows)), bounds)
    groups: dict[tuple[int, bytes], list[np.ndarray]] = {}
    for idx in spans:
        key = (int(row_role[idx[0]]), t.op[rows[idx]].tobytes() + t.kind[rows[idx]].tobytes())
        groups.setdefault(key, []).append(idx)
    for members in groups.values():
        if len(members) < 2:
            continue
        block = np.stack(members)                              # (ranks, ops)
        alt[block] = loo_median(contrib[block])
    return alt


def _stage_factor(g: StepGraph, work: np.ndarray, row_role: np.ndarray, stage: int) -> float | None:
    per_rank = np.bincount(g.rank_of_row, weights=work, minlength=len(g.ranks))
    rank_role = np.zeros(len(g.ranks), np.int64)
    rank_role[g.rank_of_row] = row_role
    medians = {s: float(np.median(per_rank[rank_role == s])) for s in np.unique(rank_role).tolist()}
    mine = medians.get(stage)
    others = [v for s, v in medians.items() if s != stage]
    if not mine or not others:
        return None
    return float(np.median(others)) / mine


def _op_median(g: StepGraph, is_op: np.ndarray, row_role: np.ndarray, work: np.ndarray,
               seg: np.ndarray, tail: np.ndarray, c: int) -> None:
    """Column ``c``: every row of one op name at its role's median this step."""
    if not is_op.any():
        return
    new = work.copy()
    for role in np.unique(row_role[is_op]).tolist():
        rows = is_op & (row_role == role) & ~g.blocking
        if rows.any():
            new[rows] = np.median(g.dur[rows])
    changed = np.bincount(g.seg_of, weights=g.gap + new, minlength=g.n_seg)
    seg[:, c] = changed
    slots = is_op[g.slot_row]
    if slots.any():
        tail[slots, c] = np.median(g.tail[slots])


def _run(g: StepGraph, seg: np.ndarray, tail: np.ndarray, begin: np.ndarray | None) -> np.ndarray:
    """Replay one step's graph, every scenario column at once: (R, C) the ranks' ends.
    ``begin``: (R, C) when each rank begins (its last step's replayed end); None: 0."""
    m, C = len(g.slot_row), seg.shape[1]
    start = np.zeros((len(g.ranks), C)) if begin is None else begin
    slot_rank = g.rank_of_row[g.slot_row]
    end = np.zeros((m, C))
    arrive = np.zeros((m, C))
    for lv, cuts, counts in zip(g.levels, g.cuts, g.counts):
        prev = g.slot_prev[lv]
        arr = np.where((prev >= 0)[:, None], end[np.maximum(prev, 0)], start[slot_rank[lv]]) + seg[g.slot_seg[lv]]
        arrive[lv] = arr
        top = np.repeat(np.maximum.reduceat(arr, cuts, axis=0), counts, axis=0)
        dep = g.slot_dep[lv]
        waits = dep >= 0
        if waits.any():
            top[waits] = np.maximum(top[waits], arrive[dep[waits]])
        end[lv] = top + tail[lv]
    last = g.last_slot
    return np.where((last >= 0)[:, None], end[np.maximum(last, 0)] if m else 0.0, start) + seg[g.tail_seg]
