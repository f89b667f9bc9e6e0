"""One step's dependency graph, built from its operations (:mod:`.replay` replays it).

Each rank's operations form a chain in time order.  Its *blocking* operations (collectives and
P2P) are the graph's slots: a rank reaches a slot after its previous slot's end plus the
operations between them (their durations and the gaps before each, as measured: a rank's
*segments*), and leaves it when its partners allow:

* a collective, matched by (``group``, ``seq``), ends for each member at the last member's
  arrival plus that member's measured tail (its end less the last arrival): it cannot
  complete before the last member issues it;
* a receive, matched to its send by (sender, receiver, ``seq``) through ``peer``, ends at the
  later of its own arrival and the send's, plus its measured tail; a send ends its own
  duration after it is posted;
* a P2P operation named neither send nor receive is a two-member collective;
* a blocking operation without the keys that pair it keeps its measured duration.

Slots get a *level*: one more than every slot they wait on, so that a level's slots can be
replayed together.  A trace whose pairings make a cycle cannot be replayed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rankwatch.agent.analyze.table import KINDS, NOT_SET, OpTable

__all__ = ["ReplayError", "StepGraph", "build"]

_COLLECTIVE, _P2P = KINDS.index("collective"), KINDS.index("p2p")
_MAX_DEPTH = 1 << 14   # blocking operations one after another in one rank-step


class ReplayError(ValueError):
    """A step whose operations cannot be replayed (a cycle of pairings)."""


@dataclass
class StepGraph:
    """Rows are one step's operations, sorted by (rank, start).  ``seg_of[i]``: the segment
    row ``i`` adds to (a rank's segment ``k`` precedes its ``k``-th slot; the last is its tail);
    ``blocking[i]``: row ``i`` is a slot, ``slot_of[i]`` its index."""

    rank_of_row: np.ndarray      # (n,) row -> index into ranks
    ranks: np.ndarray            # (R,) rank numbers
    gap: np.ndarray              # (n,) measured gap before each row (the first: since the step's start)
    dur: np.ndarray              # (n,) measured duration
    blocking: np.ndarray         # (n,) bool: a replayed slot
    seg_of: np.ndarray           # (n,) segment index
    tail_seg: np.ndarray         # (R,) each rank's tail segment
    n_seg: int
    slot_row: np.ndarray         # (m,) slot -> row
    slot_seg: np.ndarray         # (m,) the segment before it
    slot_prev: np.ndarray        # (m,) the rank's previous slot, -1 for its first
    slot_dep: np.ndarray         # (m,) a receive's send slot, else -1
    slot_inst: np.ndarray        # (m,) its instance (slots that end together)
    tail: np.ndarray             # (m,) measured end less the instance's last arrival
    levels: list[np.ndarray]     # slots per level, sorted by instance
    cuts: list[np.ndarray]       # per level, where each instance's slots begin in it
    counts: list[np.ndarray]     # per level, each instance's slots
    last_slot: np.ndarray        # (R,) each rank's last slot, -1 for none
    measured: float              # the step's time: first start to last end
    ends: np.ndarray             # (R,) each rank's measured end
    unpaired: int                # blocking rows replayed at their measured duration


def build(t: OpTable, rows: np.ndarray, names_kind: np.ndarray, origin_of: np.ndarray | None = None) -> StepGraph:
    """The graph of one step's ``rows`` of ``t`` (sorted by rank, then start).
    ``names_kind``: per op name, 1 for a send, 2 for a receive, 0 otherwise.  ``origin_of``:
    per rank of the step (ascending), where its first gap is counted from (its previous
    step's end, chained); None: the step's first start."""
    rank = t.rank[rows]
    start, dur = t.start[rows], t.duration[rows]
    ranks, rank_of_row = np.unique(rank, return_inverse=True)
    origin = float(start.min())
    n = len(rows)
    first = np.ones(n, dtype=bool)
    first[1:] = rank[1:] != rank[:-1]
    gap = np.empty(n)
    gap[0] = start[0] - origin
    gap[1:] = start[1:] - (start[:-1] + dur[:-1])
    gap[first] = start[first] - (origin if origin_of is None else origin_of[rank_of_row[first]])
    key, direction = _pairing(t, rows, names_kind)
    blocking = key[:, 0] >= 0
    # Segments: per rank, one before each slot and a tail; a row adds to the segment of the
    # next slot at or after it (a slot's own gap too).
    before: np.ndarray = np.cumsum(blocking) - blocking                      # slots before each row (global)
    rank_first_slot = np.zeros(len(ranks), np.int64)
    starts_at = np.flatnonzero(first)
    rank_first_slot[rank_of_row[starts_at]] = before[starts_at]
    slots_in_rank = np.bincount(rank_of_row, weights=blocking, minlength=len(ranks)).astype(np.int64)
    seg_base = np.cumsum(slots_in_rank + 1) - (slots_in_rank + 1)
    seg_of = seg_base[rank_of_row] + (before - rank_first_slot[rank_of_row])
    tail_seg = seg_base + slots_in_rank
    slot_row = np.flatnonzero(blocking)
    m = len(slot_row)
    slot_rank = rank_of_row[slot_row]
    slot_prev = np.arange(m) - 1
    if m:
        slot_prev[np.r_[True, slot_rank[1:] != slot_rank[:-1]]] = -1
    last_slot = np.full(len(ranks), -1, np.int64)
    last_slot[slot_rank] = np.arange(m)
    inst, dep = _instances(key[slot_row], direction[slot_row])
    end = start + dur
    arrival = start[slot_row]
    # the last arrival of each instance (a receive's: its send's arrival too)
    last_arr = np.full(inst.max() + 1 if m else 0, -np.inf)
    np.maximum.at(last_arr, inst, arrival)
    eff = last_arr[inst]
    has_dep = dep >= 0
    eff[has_dep] = np.maximum(eff[has_dep], arrival[dep[has_dep]])
    tail = end[slot_row] - eff
    return StepGraph(rank_of_row=rank_of_row, ranks=ranks, gap=gap, dur=dur, blocking=blocking, seg_of=seg_of,
                     tail_seg=tail_seg, n_seg=int(seg_base[-1] + slots_in_rank[-1] + 1), slot_row=slot_row,
                     slot_seg=seg_of[slot_row], slot_prev=slot_prev, slot_dep=dep, slot_inst=inst, tail=tail,
                     **_levels(slot_prev, dep, inst), last_slot=last_slot,
                     measured=float(end.max() - origin), ends=_rank_ends(end, rank_of_row, len(ranks)), unpaired=int(((t.kind[rows] == _COLLECTIVE)
                                                                        | (t.kind[rows] == _P2P)).sum() - m))


def _pairing(t: OpTable, rows: np.ndarray, names_kind: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the key its partners share (``-1`` in column 0: not a slot) and its direction
    (0: symmetric, 1: send, 2: receive)."""
    n = len(rows)
    key = np.full((n, 4), -1, np.int64)
    direction = np.zeros(n, np.int8)
    kind = t.kind[rows]
    seq = t.column("seq")
    if seq is None:
        return key, direction
    q = seq[rows]
    if t.group is not None:
        g = t.group[rows].astype(np.int64)
        coll = (kind == _COLLECTIVE) & (g != NOT_SET) & (q != NOT_SET)
        key[coll] = np.stack([np.zeros(coll.sum(), np.int64), g[coll], q[coll], np.zeros(coll.sum(), np.int64)], 1)
    peer = t.column("peer")
    if peer is not None:
        p, r = peer[rows], t.rank[rows]
        p2p = (kind == _P2P) & (p != NOT_SET) & (q != NOT_SET)
        d = names_kind[t.op[rows]].astype(np.int8)
        sender = np.where(d == 2, p, np.where(d == 1, r, np.minimum(r, p)))
        receiver = np.where(d == 2, r, np.where(d == 1, p, np.maximum(r, p)))
        key[p2p] = np.stack([np.ones(p2p.sum(), np.int64), sender[p2p], receiver[p2p], q[p2p]], 1)
        direction[p2p] = d[p2p]
    return key, direction


def _instances(key: np.ndarray, direction: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each slot's instance (slots that end together) and, for a receive, its send's slot.
    A send and its receive share a key but end apart: each is its own instance."""
    m = len(key)
    if not m:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    _, pair = np.unique(key, axis=0, return_inverse=True)
    pair = pair.ravel()
    directed = direction > 0
    inst = np.where(directed, pair.max() + 1 + np.arange(m), pair)
    _, inst = np.unique(inst, return_inverse=True)
    dep = np.full(m, -1, np.int64)
    sends = np.flatnonzero(direction == 1)
    send_of_pair = np.full(pair.max() + 1, -1, np.int64)
    send_of_pair[pair[sends]] = sends
    recvs = np.flatnonzero(direction == 2)
    dep[recvs] = send_of_pair[pair[recvs]]
    return inst.ravel(), dep


def _levels(prev: np.ndarray, dep: np.ndarray, inst: np.ndarray) -> dict[str, list[np.ndarray]]:
    """Slots grouped by level (each slot one above everything it waits on), each level's
    slots sorted by instance, with where each instance begins and its size.  Raises
    :class:`ReplayError` on a cycle."""
    m = len(prev)
    if not m:
        return {"levels": [], "cuts": [], "counts": []}
    lvl = np.zeros(m, np.int64)
    has_prev, has_dep = prev >= 0, dep >= 0
    for _ in range(min(m, _MAX_DEPTH) + 1):
        new = np.zeros(m, np.int64)
        new[has_prev] = lvl[prev[has_prev]] + 1
        new[has_dep] = np.maximum(new[has_dep], lvl[dep[has_dep]] + 1)
        top = np.zeros(inst.max() + 1, np.int64)
        np.maximum.at(top, inst, new)
        new = top[inst]
        if np.array_equal(new, lvl):
            order = np.lexsort((inst, lvl))
            levels = np.split(order, np.flatnonzero(np.diff(lvl[order])) + 1)
            cuts = [np.flatnonzero(np.concatenate(([True], inst[lv][1:] != inst[lv][:-1]))) for lv in levels]
            counts = [np.diff(np.append(c, len(lv))) for c, lv in zip(cuts, levels)]
            return {"levels": levels, "cuts": cuts, "counts": counts}
        lvl = new
    raise ReplayError(f"the step's pairings form a cycle or are more than {_MAX_DEPTH} deep "
                      "(a collective or P2P that waits on itself)")


def _rank_ends(end: np.ndarray, rank_of_row: np.ndarray, n: int) -> np.ndarray:
    out = np.full(n, -np.inf)
    np.maximum.at(out, rank_of_row, end)
    return out
