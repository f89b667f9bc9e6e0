"""One rank-step as rows of the rankwatch trace format, tiled so that an analyser reads back
exactly the own work, data wait and collective wait the live detectors used.

What a rank reports of a step (``StepColumns``): its start and wall duration ``D``, its phases
(data, forward, backward, optimizer; data net of any wait inside it) and ``W``, the time its
training thread was blocked in collectives.  Of each collective (``CollectiveColumns``): issue
time ``t0`` and completion ``t1`` (when the wait for it returned).  The live agent counts
``own = max(0, D - W)``, ``data`` and ``wait = W``.

The rule (:func:`tile_step`):

* The step covers ``[S, S + L]`` with ``L = max(D, W)`` (``L = D`` but where more wait was
  charged to the step than its wall time, which a step dated from the previous one's end can).
* A collective belongs to the step its ``t1`` falls in.  Its row is the part of it the rank
  was blocked in, and it *ends* at ``t1``: the wait returns when the collective completes.
  Each collective may be blocked from ``max(t0, S, the previous collective's t1)`` on; the
  step's ``W`` is spread over the collectives in proportion to that room.  Where the room is
  less than ``W`` (a wait with no record: a dropped record, or DDP's gradient buckets waited
  for as a whole), the rest is one ``wait`` row of kind ``collective`` after the backward.
* Every other instant of the step is own work, laid out in phase order, in the rank's own
  time (the time not blocked): ``data`` (kind ``data``) first, then ``forward`` and
  ``backward`` (``compute``), ``optimizer`` (``optimizer``) and ``other`` (``host``: time no
  phase marked), each of the last four sharing ``L - W - data`` in proportion to its gross
  time.  A phase that a wait interrupts is split into several rows of the same ``op``.

So, per rank-step: ``max(start + duration) - min(start) = L``, the ``collective`` and ``p2p``
rows sum to ``W``, the ``data`` rows to ``data`` (at most ``L - W``), and span less wait is
the live ``own``, to float rounding.  Rows never overlap.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from itertools import accumulate
from typing import Any, NamedTuple

import numpy as np

__all__ = ["COLL_DTYPE", "MESH_COLUMNS", "P2P_OPS", "RankRows", "Row", "StepTimes", "tile_step"]

P2P_OPS = frozenset({"send", "recv"})
COLL_DTYPE = np.dtype([("op", "<i2"), ("group", "<i4"), ("seq", "<i8"), ("t0", "<f8"), ("t1", "<f8"),
                       ("nbytes", "<i8")])
"""A rank's pending collective records: op index, group index (-1: unnamed), seq, issue and
completion time (Unix seconds), size."""


class StepTimes(NamedTuple):
    """One step record as the rank reported it (seconds; ``start`` Unix)."""

    step: int
    start: float
    duration: float
    data: float
    forward: float
    backward: float
    optimizer: float
    wait: float


class Row(NamedTuple):
    """One operation: ``coll`` indexes the step's collective records (-1: not a collective)."""

    op: str
    kind: str
    start: float
    duration: float
    coll: int = -1


_PHASES = (("forward", "compute"), ("backward", "compute"), ("optimizer", "optimizer"), ("other", "host"))


def _blocked(s: StepTimes, t0: Sequence[float], t1: Sequence[float], end: float) -> tuple[list[float], list[float]]:
    """Each collective's blocked time and where it ends (``t1`` clipped to the step), in the
    order given (sorted by ``t1``).  (Plain floats: a step has a few collectives, and numpy's
    call overhead was most of the writer's time.)"""
    rooms, his, prev = [], [], s.start
    for a, b in zip(t0, t1):
        hi = min(b, end)
        rooms.append(max(hi - max(a, prev), 0.0))
        his.append(hi)
        prev = max(prev, hi)
    total = sum(rooms)
    if total > s.wait and total > 0:
        scale = s.wait / total
        rooms = [r * scale for r in rooms]
    return rooms, his


def _free_gaps(start: float, end: float, b: list[float], hi: list[float]) -> list[tuple[float, float]]:
    """``[start, end]`` less the blocked intervals ``[hi - b, hi]`` (disjoint, ordered)."""
    gaps, at = [], start
    for bi, h in zip(b, hi):
        if bi <= 0:
            continue
        if h - bi > at:
            gaps.append((at, h - bi))
        at = max(at, h)
    if end > at:
        gaps.append((at, end))
    return gaps


def _own_segments(s: StepTimes, own: float, rest_wait: float) -> list[tuple[str, str, float]]:
    """(op, kind, length) in the order they are laid out in the step's free time."""
    data = min(s.data, own)
    other = max(0.0, s.duration - s.data - s.forward - s.backward - s.optimizer)
    gross = (s.forward, s.backward, s.optimizer, other)
    total = sum(gross)
    left = own - data
    lengths = [g * left / total for g in gross] if total > 0 else [0.0, 0.0, 0.0, left]
    segs = [("data", "data", data)]
    for (op, kind), length in zip(_PHASES, lengths):
        segs.append((op, kind, length))
        if op == "backward" and rest_wait > 1e-9:
            segs.append(("wait", "collective", rest_wait))
    return segs


def _lay_out(segs: list[tuple[str, str, float]], gaps: list[tuple[float, float]]) -> list[Row]:
    """Segments poured into the gaps in order, each cut where a gap ends.  Positions are
    counted in free time (the gaps end to end); the last segment ends where the last gap does."""
    live = [seg for seg in segs if seg[2] > 1e-12]
    if not live or not gaps:
        return []
    bounds = list(accumulate((length for *_, length in live), initial=0.0))
    bounds[-1] = sum(g1 - g0 for g0, g1 in gaps)
    rows: list[Row] = []
    gi, gpos = 0, 0.0   # the gap poured into, and its start in free time
    for (op, kind, _), a, b in zip(live, bounds, bounds[1:]):
        while gi < len(gaps):
            g0, g1 = gaps[gi]
            gend = gpos + (g1 - g0)
            lo, hi = max(a, gpos), min(b, gend)
            if hi > lo:
                begin = g0 + (lo - gpos)
                rows.append(Row(op, kind, begin, (g1 if hi >= gend else g0 + (hi - gpos)) - begin))
            if gend > b:
                break   # the segment ends inside this gap
            gi, gpos = gi + 1, gend
    return rows


def tile_step(s: StepTimes, t0: Sequence[float], t1: Sequence[float], p2p: Sequence[bool]) -> list[Row]:
    """The rows of step ``s`` (see the module's rule), ordered by start.

    Args:
        s: the step record.
        t0, t1: issue and completion times of the collectives whose ``t1`` falls in the step,
            sorted by ``t1``.
        p2p: per collective, whether it is a send or a receive (kind ``p2p``).
    """
    # Laid out on the step's own clock (seconds from its start): a Unix time holds a quarter
    # of a microsecond at best, and durations taken as differences of them would not sum right.
    origin, span = s.start, max(s.duration, s.wait)
    s = s._replace(start=0.0)
    b, hi = _blocked(s, [t - origin for t in t0], [t - origin for t in t1], span)
    gaps = _free_gaps(0.0, span, b, hi)
    rows = _lay_out(_own_segments(s, span - s.wait, max(0.0, s.wait - sum(b))), gaps)
    for i, (bi, h) in enumerate(zip(b, hi)):
        rows.append(Row("", "p2p" if p2p[i] else "collective", h - bi, bi, i))
    if not rows:   # an empty step still shows that it happened
        rows.append(Row("other", "host", 0.0, 0.0))
    rows.sort(key=lambda r: (r.start, r.coll))
    return [r._replace(start=origin + r.start) for r in rows]


MESH_COLUMNS = ("dp", "pp", "tp", "ep", "cp", "replicate")
"""Mesh dimensions written as columns (``shard`` is written as ``dp`` where no ``dp`` is)."""
MAX_PENDING = 1 << 16
"""Collective records a rank may have waiting for their step's record (the newest are kept)."""
MAX_GROUPS = 1024
"""Process-group names kept per rank (a record of a group beyond them is written unnamed)."""
_SLACK = 1e-6   # seconds: a collective completing this close to a step's edge is the step's


class RankRows:
    """One rank's collective records waiting for the step they fall in, and the JSON Lines of
    its steps once their step records arrive (:func:`tile_step`).

    Args:
        rank, node: the rank and its node.
        op_names: the names of the op indices its collective records carry.
    """

    def __init__(self, rank: int, node: str, op_names: Sequence[str]) -> None:
        self.rank, self.node = rank, node
        self._ops = [json.dumps(str(name)) for name in op_names]
        self._p2p = np.array([name in P2P_OPS for name in op_names] or [False])
        self._groups: dict[str, int] = {}
        self._group_json: list[str] = []
        self._pending = np.empty(0, COLL_DTYPE)
        self._coords: Mapping[str, int] | None = None
        self._job = ""
        self._ident = ""
        self.outside = 0
        """Collective records dropped: outside every step, or over :data:`MAX_PENDING`."""

    def add_collectives(self, ops: np.ndarray, cols: Mapping[str, np.ndarray], names: Sequence[str]) -> None:
        """A batch's collective records (``ops``: op indices; ``names``: group name per pg code)."""
        lut = np.array([self._group(name) for name in names] or [-1], np.int32)
        pg = cols["pg"].astype(np.int64)
        rec = np.empty(len(ops), COLL_DTYPE)
        rec["op"] = np.where(ops < len(self._ops), ops, 0)
        rec["group"] = np.where(pg < len(names), lut[np.minimum(pg, len(lut) - 1)], -1)
        rec["seq"], rec["t0"], rec["nbytes"] = cols["seq"], cols["start"], cols["nbytes"]
        rec["t1"] = cols["start"] + cols["duration"]
        merged = np.concatenate([self._pending, rec])
        if len(merged) > MAX_PENDING:
            self.outside += len(merged) - MAX_PENDING
            merged = merged[-MAX_PENDING:]
        self._pending = merged

    def _group(self, name: str) -> int:
        gid = self._groups.get(name)
        if gid is None:
            if len(self._groups) >= MAX_GROUPS or not name:
                return -1
            gid = self._groups[name] = len(self._group_json)
            self._group_json.append(json.dumps(name))
        return gid

    def lines(self, steps: Any, coords: Mapping[str, int], job: str = "") -> list[str]:
        """The JSON Lines of a batch's step records (``StepColumns``), mesh ``coords`` and the
        ``job`` id (torchrun's run id, if any) written."""
        if coords is not self._coords or job != self._job:
            self._coords, self._job, self._ident = coords, job, _ident(self.node, coords, job)
        n = len(steps.step)
        waits = list(steps.wait) or [0.0] * n
        starts = np.asarray(steps.start, np.float64)
        spans = np.maximum(np.asarray(steps.duration, np.float64), np.asarray(waits, np.float64))
        groups = self._split(starts, np.maximum.accumulate(starts + spans) + _SLACK)
        out: list[str] = []
        for i, colls in enumerate(groups):
            s = StepTimes(int(steps.step[i]), steps.start[i], steps.duration[i], steps.data[i], steps.forward[i],
                          steps.backward[i], steps.optimizer[i], waits[i])
            out.extend(self._step_lines(s, colls))
        return out

    def _split(self, starts: np.ndarray, ends: np.ndarray) -> list[np.ndarray]:
        """The waiting collective records of each step (by ``t1``, in order); the records of
        no step are dropped, those after the last step kept waiting."""
        p = self._pending
        at = np.searchsorted(ends, p["t1"], side="left")      # the first step ending after each
        done = at < len(ends)
        inside = done & (p["t1"] >= starts[np.minimum(at, len(ends) - 1)] - _SLACK)
        self.outside += int(done.sum() - inside.sum())
        self._pending = p[~done]
        taken, step_of = p[inside], at[inside]
        order = np.lexsort((taken["t1"], step_of))
        taken, step_of = taken[order], step_of[order]
        cuts = np.searchsorted(step_of, np.arange(len(ends) + 1))
        return [taken[cuts[i]:cuts[i + 1]] for i in range(len(ends))]

    def _step_lines(self, s: StepTimes, colls: np.ndarray) -> list[str]:
        rows = tile_step(s, colls["t0"].tolist(), colls["t1"].tolist(), self._p2p[colls["op"]].tolist())
        head = f'{{"rank":{self.rank},"step":{s.step},'
        ident = self._ident
        tails = self._tails(colls) if len(colls) else []
        out = []
        for r in rows:
            body = f'"start":{r.start!r},"duration":{round(r.duration, 9)!r}{ident}'
            if r.coll < 0:
                out.append(f'{head}"op":"{r.op}","kind":"{r.kind}",{body}}}')
            else:
                op, tail = tails[r.coll]
                out.append(f'{head}"op":{op},"kind":"{r.kind}",{body}{tail}')
        return out

    def _tails(self, colls: np.ndarray) -> list[tuple[str, str]]:
        """Per collective: its op (JSON) and its columns after the identity (group, seq, bytes)."""
        out = []
        for op, g, seq, nbytes in zip(colls["op"].tolist(), colls["group"].tolist(), colls["seq"].tolist(),
                                      colls["nbytes"].tolist()):
            group = f',"group":{self._group_json[g]}' if g >= 0 else ""
            number = f',"seq":{seq}' if seq >= 0 else ""
            out.append((self._ops[op], f'{group}{number},"bytes":{nbytes}}}'))
        return out


def _ident(node: str, coords: Mapping[str, int], job: str) -> str:
    """The columns every row of a rank carries: its node, mesh coordinates and job (a column
    the trace format does not name, so readers ignore it; :mod:`rankwatch.agent.analyze.agent_record`
    reads the latest job's files by it)."""
    cols = {k: int(v) for k, v in coords.items() if k in MESH_COLUMNS}
    if "dp" not in cols and "shard" in coords:
        cols["dp"] = int(coords["shard"])
    mesh = "".join(f',"{k}":{v}' for k, v in sorted(cols.items()))
    return f',"node":{json.dumps(node)}{mesh}' + (f',"job":{json.dumps(job)}' if job else "")
