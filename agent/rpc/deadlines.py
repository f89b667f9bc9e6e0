"""Deadlines for many short waits, on one thread: arming and disarming cost no wake-up.

The agent's front door (:mod:`rankwatch.agent.rpc.gate`) arms one deadline per unary call (its
request must arrive in time) and disarms it a few milliseconds later, thousands of times a
second at a busy coordinator.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["Watchdog"]

log = logging.getLogger(__name__)


class Watchdog:
    """One thread that runs callbacks at their deadlines; arming and disarming are cheap.

    Every unary call arms one deadline and disarms it a few milliseconds later, so neither
    may cost a wake-up of the thread: an entry is pushed on a heap (O(1) when deadlines come
    in order, as one timeout per kind of wait makes them), the thread is notified only when
    the new deadline is earlier than the one it sleeps towards, and a cancel just clears the
    entry's callback (no lock).  The thread drops cleared entries as they reach the head, so
    it wakes about once per timeout, not once per call, and the heap holds about the
    deadlines armed within the longest timeout (a few thousand entries at a busy coordinator).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._heap: list[list[Any]] = []   # [deadline, order, callback or None when cancelled]
        self._order = itertools.count()
        self._wake_at = math.inf           # the deadline the thread sleeps towards
        self._thread: threading.Thread | None = None

    def after(self, seconds: float, callback: Callable[[], None]) -> list[Any]:
        """Run ``callback`` in ``seconds`` unless :meth:`cancel` is given the returned handle first."""
        entry: list[Any] = [time.monotonic() + seconds, next(self._order), callback]
        with self._cond:
            heapq.heappush(self._heap, entry)
            if entry[0] < self._wake_at:   # the thread would sleep past it: wake it
                self._wake_at = entry[0]
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="rankwatch-deadlines", daemon=True)
                    self._thread.start()
                self._cond.notify()
        return entry

    @staticmethod
    def cancel(handle: list[Any]) -> None:
        handle[2] = None

    def pending(self) -> int:
        """Entries held, cancelled ones not yet dropped included (for tests)."""
        with self._cond:
            return len(self._heap)

    def _run(self) -> None:
        heap = self._heap
        while True:
            with self._cond:
                while True:
                    while heap and heap[0][2] is None:
                        heapq.heappop(heap)   # cancelled
                    now = time.monotonic()
                    if heap and heap[0][0] <= now:
                        break
                    self._wake_at = heap[0][0] if heap else math.inf
                    self._cond.wait(self._wake_at - now if heap else None)
                entry = heapq.heappop(heap)
                callback, entry[2] = entry[2], None
                self._wake_at = -math.inf   # busy: arming needs no notify until it sleeps again
            try:
                callback()
            except Exception:  # noqa: BLE001 - a deadline never kills the watchdog
                log.exception("deadline callback failed")
