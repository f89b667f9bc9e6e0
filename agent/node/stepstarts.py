"""When each rank's recent steps began (and how long it spent between them): the straggler
detector's view of late collectives and of work outside the step scope.

A rank whose collectives complete late for it (a slow link, a slow NIC, a
congested switch port) leaves each step's last collective after the others,
so its next step starts after theirs, while its own work stays normal.  The
ranks of one node stamp their steps with one clock; across nodes this
assumes clocks synchronised well below a step (NTP or PTP).

:class:`StepStarts` is a :class:`NodeState` step listener: it keeps each
rank's last step starts, aligned with its completed-step count.
"""

from __future__ import annotations

import threading
from collections import deque

from rankwatch.agent.node.intake import RankState
from rankwatch.proto import pb

__all__ = ["StepStarts"]


class StepStarts:
    """Args:
        maxlen: steps kept per rank (match the agent's own-work window).
    """

    def __init__(self, maxlen: int = 64) -> None:
        self._maxlen = maxlen
        self._lock = threading.Lock()
        # rank -> (pid, steps completed after the newest entry, starts oldest first)
        self._starts: dict[int, tuple[int, int, deque[float]]] = {}
        # rank -> time before each step since the previous step's end, aligned with the starts
        self._gaps: dict[int, deque[float]] = {}
        self._ends: dict[int, float] = {}

    def on_steps(self, rank: RankState, steps: pb.StepColumns) -> None:
        """The state's step listener: called after each batch of ``rank``'s steps is applied."""
        with self._lock:
            held = self._starts.get(rank.rank)
            same = held is not None and held[0] == rank.pid
            starts = held[2] if held is not None and same else deque(maxlen=self._maxlen)
            gaps = self._gaps[rank.rank] if same else deque(maxlen=self._maxlen)
            end = self._ends.get(rank.rank) if same else None
            for start, duration in zip(steps.start, steps.duration):
                gaps.append(max(0.0, start - end) if end is not None else float("nan"))
                end = start + duration
            starts.extend(steps.start)
            self._starts[rank.rank] = (rank.pid, rank.steps_completed, starts)
            self._gaps[rank.rank] = gaps
            if end is not None:
                self._ends[rank.rank] = end

    def gaps_for_rank(self, rank: int, completed: int) -> list[float] | None:
        """The rank's time between its steps (outside any step scope), aligned as
        :meth:`for_rank`; NaN before its first step here."""
        with self._lock:
            held = self._starts.get(rank)
            if held is None or held[1] < completed:
                return None
            gaps = list(self._gaps.get(rank, ()))
        extra = held[1] - completed
        return gaps[:len(gaps) - extra] if extra else gaps

    def latest(self, rank: int) -> list[float]:
        """The rank's step starts held, oldest first, whatever its completed count."""
        with self._lock:
            held = self._starts.get(rank)
            return list(held[2]) if held is not None else []

    def for_rank(self, rank: int, completed: int) -> list[float] | None:
        """The rank's step starts with the last one at step ``completed``, or None if not held."""
        with self._lock:
            held = self._starts.get(rank)
            if held is None or held[1] < completed:
                return None
            starts = list(held[2])
        extra = held[1] - completed  # steps that arrived after the caller's snapshot
        return starts[:len(starts) - extra] if extra else starts
