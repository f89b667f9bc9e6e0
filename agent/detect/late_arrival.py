"""Who arrived last at each collective, and how long the others waited for it.

A collective cannot complete before its last member issues it, so the members that issued
it earlier wait, wherever in the step it sits: a token count all-gathered before the
forward, a loss all-reduce, an all-to-all between experts, a barrier.  A rank's *late
arrival* at one collective is how much later it issued it than the median of the other
members did, counted for the last member only (the others were not waited for); summed over
a step, it is the time the step lost waiting for that rank, the straggler's primary evidence
(:mod:`.work_scores`).  It shows what the rank's own work cannot: a rank stopped inside a
collective (a SIGSTOP, a preempted host) leaves it late, so it issues the next one late,
though its own work is unchanged.

Issue times are compared on one clock: the ranks of one node stamp them with the node's
clock.  The node agent lines up its own ranks' records of each collective by its process
group's name and sequence number (every member numbers a group's collectives alike); a
collective with members on other nodes is judged among the node's members only.

Pure functions over arrays of records; :mod:`rankwatch.agent.node.arrivals` keeps them.
"""

from __future__ import annotations

import numpy as np

__all__ = ["last_arrivals", "step_late"]


def last_arrivals(group: np.ndarray, seq: np.ndarray, start: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Over records of collectives (one per member: its group id, sequence number and issue
    time), each record's late arrival (seconds, 0 for all but a collective's last member) and
    whether its collective had another member among the records.

    The last member's late arrival is its issue time less the median of the other members'.
    Records of one collective share (group, seq); a record alone in its collective is
    ``False`` in the second array (its other members' records may come later).
    """
    n = len(start)
    late = np.zeros(n)
    if n == 0:
        return late, np.zeros(0, dtype=bool)
    order = np.lexsort((start, seq, group))
    g, q, s = group[order], seq[order], start[order]
    new_run = np.ones(n, dtype=bool)
    new_run[1:] = (g[1:] != g[:-1]) | (q[1:] != q[:-1])
    begins = np.flatnonzero(new_run)
    ends = np.append(begins[1:], n)
    sizes = ends - begins
    paired = np.repeat(sizes > 1, sizes)
    many = sizes > 1
    b, e = begins[many], ends[many]
    others = e - 1 - b                       # the members before the last, sorted by issue time
    lo = b + (others - 1) // 2
    hi = b + others // 2
    median = 0.5 * (s[lo] + s[hi])
    out = np.zeros(n)
    out[e - 1] = np.maximum(s[e - 1] - median, 0.0)
    late[order] = out
    matched = np.empty(n, dtype=bool)
    matched[order] = paired
    return late, matched


def step_late(who: np.ndarray, step: np.ndarray, group: np.ndarray, seq: np.ndarray,
              late: np.ndarray) -> dict[tuple[int, int], float]:
    """Each (rank, step)'s late arrival: per peer that waited for it, the late arrivals of the
    collectives it issued last in that step, summed; the step takes the largest peer's sum.

    A rank 30 ms behind arrives 30 ms late at its TP collective (its TP peer waits) and again at
    its DP collective (its DP peer waits): the job lost 30 ms, not 60.  Two stops that make it
    late twice for the same peer are two losses.  (The node agent applies the same rule as the
    records settle: :mod:`rankwatch.agent.node.arrivals`.)  Records as :func:`last_arrivals`
    takes them, with each record's rank (``who``), step and late arrival (``late``, from it).
    """
    last = np.flatnonzero(late > 0)
    if not last.size:
        return {}
    order = np.lexsort((seq, group))
    g, q = group[order], seq[order]
    new = np.ones(len(order), dtype=bool)
    new[1:] = (g[1:] != g[:-1]) | (q[1:] != q[:-1])
    begins = np.flatnonzero(new)
    ends = np.append(begins[1:], len(order))
    inst = np.empty(len(order), dtype=np.int64)
    inst[order] = np.cumsum(new) - 1                      # each record's collective
    b, e = begins[inst[last]], ends[inst[last]]
    sizes = e - b
    owner = np.repeat(last, sizes)                        # the late record, once per member
    offset = np.arange(sizes.sum()) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    peer = who[order[np.repeat(b, sizes) + offset]]
    keep = peer != who[owner]
    owner, peer = owner[keep], peer[keep]
    keys = np.stack([who[owner], step[owner], peer])
    uniq, inv = np.unique(keys, axis=1, return_inverse=True)
    sums = np.bincount(inv.ravel(), weights=late[owner])
    out: dict[tuple[int, int], float] = {}
    for r, st, v in zip(uniq[0].tolist(), uniq[1].tolist(), sums.tolist()):
        if v > out.get((r, st), 0.0):
            out[(r, st)] = v
    return out
