"""Each of the node's ranks' late arrivals at collectives, summed per step.

A :class:`NodeState` listener of both kinds: it keeps every rank's recent collective records
(group id, sequence number, issue and completion time) and the end of each of its steps.
Four times a second the agent's sweep calls :meth:`Arrivals.settle`: the records of
collectives that completed at least ``settle_seconds`` ago (every member's record has been
flushed by then: ranks flush every 100 ms) are lined up by (group, sequence number), the last
member of each is found (:func:`~rankwatch.agent.detect.late_arrival.last_arrivals`), and
its late arrival is added to the step it issued the collective in: the first of its steps
that ended after it (a collective between two steps is the next step's, as zero-code dates a
step from the last one's end).  A step's late arrival is summed per *peer* (each member that
waited), and the step takes the largest peer's sum: a rank 30 ms behind arrives 30 ms late at
its TP collective (rank 3 waits) and again at its DP collective (rank 0 waits), but the job
lost 30 ms, not 60; two stops that make it late at two collectives with the same peer are two
losses.  P2P operations are left out (a receive waits for its send by design).

:meth:`Arrivals.for_rank` gives the straggler detector a rank's late arrival per step,
aligned with its completed steps; NaN for steps not settled yet.  Everything is bounded:
records per rank, group names, steps per rank.
"""

from __future__ import annotations

import threading
from collections import deque

import numpy as np

from rankwatch.agent.detect.late_arrival import last_arrivals
from rankwatch.agent.node.rankrecord import OP_INDEX, RankState
from rankwatch.proto import pb

__all__ = ["Arrivals"]

_P2P = np.array([OP_INDEX["send"], OP_INDEX["recv"]])
_MAX_GROUPS = 1024           # distinct group names tracked (more are not lined up)
_MAX_RECORDS = 1 << 15       # pending records per rank
_KEEP_SECONDS = 5.0          # how long a record waits for another member's


class Arrivals:
    """Args:
        settle_seconds: how long after a collective completes its records are lined up.
        maxlen: steps kept per rank (match the agent's own-work window).
    """

    def __init__(self, settle_seconds: float = 0.5, maxlen: int = 64) -> None:
        self._settle = settle_seconds
        self._maxlen = maxlen
        self._lock = threading.Lock()
        self._groups: dict[str, int] = {}
        self._pending: dict[int, tuple[int, list[np.ndarray]]] = {}   # rank -> (pid, chunks of 4 x n)
        # rank -> (pid, steps completed after the newest slot, step ends, late arrival per step
        # and waiting peer)
        self._steps: dict[int, tuple[int, int, deque[float], deque[dict[int, float]]]] = {}
        self._settled_until = 0.0

    # -- listeners (the ingesting thread) --------------------------------------------------
    def on_collectives(self, rank: RankState, ops: np.ndarray, cols: dict[str, np.ndarray],
                       names: list[str]) -> None:
        """A batch's collective records (``ops``: the agent's op indexes; ``names``: the group
        name of each pg code the rank uses)."""
        if not names:
            return
        with self._lock:
            lut = np.array([self._group_id(name) for name in names], dtype=np.int64)
            pg = cols["pg"].astype(np.int64)
            keep = (pg < lut.size) & (cols["seq"] >= 0) & ~np.isin(ops, _P2P)
            if not keep.any():
                return
            gid = lut[pg[keep]]
            keep[keep] = gid >= 0
            if not keep.any():
                return
            start = cols["start"][keep]
            chunk = np.stack([lut[pg[keep]].astype(float), cols["seq"][keep].astype(float), start,
                              start + cols["duration"][keep]])
            held = self._pending.get(rank.rank)
            chunks = held[1] if held is not None and held[0] == rank.pid else []
            chunks.append(chunk)
            while sum(c.shape[1] for c in chunks) > _MAX_RECORDS:
                chunks.pop(0)
            self._pending[rank.rank] = (rank.pid, chunks)

    def on_steps(self, rank: RankState, steps: pb.StepColumns) -> None:
        with self._lock:
            held = self._steps.get(rank.rank)
            if held is not None and held[0] == rank.pid:
                ends, late = held[2], held[3]
            else:
                ends, late = deque(maxlen=self._maxlen), deque(maxlen=self._maxlen)
            for start, duration in zip(steps.start, steps.duration):
                ends.append(start + duration)
                late.append({})
            self._steps[rank.rank] = (rank.pid, rank.steps_completed, ends, late)

    def _group_id(self, name: str) -> int:
        gid = self._groups.get(name)
        if gid is None:
            if len(self._groups) >= _MAX_GROUPS or not name:
                return -1
            gid = self._groups[name] = len(self._groups)
        return gid

    # -- the sweep -------------------------------------------------------------------------
    def settle(self, now: float) -> None:
        """Line up the records of collectives that completed ``settle_seconds`` ago or more,
        and add each last member's late arrival to its step."""
        with self._lock:
            ripe_before = now - self._settle
            ranks, cols = [], []
            for rank, (pid, chunks) in self._pending.items():
                if chunks:
                    merged = np.concatenate(chunks, axis=1)
                    ranks.append(np.full(merged.shape[1], rank))
                    cols.append(merged)
            if not cols:
                self._settled_until = ripe_before
                return
            who, rec = np.concatenate(ranks), np.concatenate(cols, axis=1)
            # Ripe: completed a while ago, and issued within a step its rank has reported
            # (a long step's collective waits for the step's end, so it is credited to it).
            last_end = np.full(len(who), -np.inf)
            for rank, held in self._steps.items():
                if held[2]:
                    last_end[who == rank] = held[2][-1]
            ripe = (rec[3] < ripe_before) & ((rec[2] <= last_end) | (rec[3] < now - _KEEP_SECONDS))
            late, matched = last_arrivals(rec[0][ripe], rec[1][ripe], rec[2][ripe])
            self._credit(who[ripe], rec[0][ripe], rec[1][ripe], rec[2][ripe], late)
            # Kept: records not ripe yet, and ripe ones still alone (for a while).
            alone = np.zeros(len(who), dtype=bool)
            alone[np.flatnonzero(ripe)[~matched]] = True
            keep = ~ripe | (alone & (rec[3] >= now - _KEEP_SECONDS))
            for rank, (pid, _) in list(self._pending.items()):
                mine = keep & (who == rank)
                self._pending[rank] = (pid, [rec[:, mine]] if mine.any() else [])
            self._settled_until = ripe_before

    def _credit(self, who: np.ndarray, group: np.ndarray, seq: np.ndarray, start: np.ndarray,
                late: np.ndarray) -> None:
        """Add each last member's late arrival to its step, for each member that waited."""
        for i in np.flatnonzero(late > 0):
            held = self._steps.get(int(who[i]))
            if held is None:
                continue
            ends, slots = held[2], held[3]
            k = int(np.searchsorted(np.asarray(ends), start[i]))   # the first step that ended after it
            if k < len(slots):
                peers = who[(group == group[i]) & (seq == seq[i]) & (who != who[i])]
                for peer in peers.tolist():
                    slots[k][peer] = slots[k].get(peer, 0.0) + float(late[i])

    def for_rank(self, rank: int, completed: int) -> list[float] | None:
        """The rank's late arrival per step (seconds), the last one at step ``completed``, as
        :meth:`~rankwatch.agent.node.stepstarts.StepStarts.for_rank` aligns them; NaN for steps
        that ended too recently to be settled."""
        with self._lock:
            held = self._steps.get(rank)
            if held is None or held[1] < completed:
                return None
            _, done, ends, late = held
            out = [max(v.values(), default=0.0) if end < self._settled_until else float("nan")
                   for end, v in zip(ends, late)]
        extra = done - completed
        return out[:len(out) - extra] if extra else out

    def forget(self, keep: set[int]) -> None:
        """Drop the ranks not in ``keep`` (gone from the node)."""
        with self._lock:
            for table in (self._pending, self._steps):
                for rank in [r for r in table if r not in keep]:
                    del table[rank]
