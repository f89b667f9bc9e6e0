"""The coordinator's measure of its own load, and what follows from it.

The rules are :mod:`pacing`'s (pure functions); this keeps the counters they read.
Each summary is counted with its delay (arrival minus sending, less its node's best).
Each evaluation measures, over windows of two seconds (at once when the loop itself ran
late), the process's CPU, its loop's lag, the median delay, the calls refused for lack
of capacity, the syncs answered after their callers' deadlines and the share of due
summaries heard.  From that follow the interval nodes
are told to sync at, whether the coordinator is overloaded, and until when no node may
be called silent.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable

from rankwatch.agent.job import pacing
from rankwatch.agent.job.pacing import LoadConfig

__all__ = ["LoadMeter"]

log = logging.getLogger(__name__)

_WINDOW = 2.0   # seconds a measurement spans


class LoadMeter:
    """Args:
        cfg: the load rules' settings.
        tick_seconds: how often the coordinator evaluates (its loop's lag is measured against it).
        node_timeout: a node is never silent before this (``PolicyConfig.node_timeout_seconds``).
        refusals: calls the agent refused for lack of capacity so far (a counter).
        burst: the most of N nodes taken for dead at once (:func:`node_death.burst_size`).
        clocks: ``(wall, cpu)``, the monotonic and the process CPU clocks it reads (for tests).
    """

    def __init__(self, cfg: LoadConfig, tick_seconds: float, node_timeout: float,
                 refusals: Callable[[], int], burst: Callable[[int], float] = lambda n: math.inf,
                 clocks: tuple[Callable[[], float], Callable[[], float]] | None = None) -> None:
        self.cfg = cfg
        self._burst = burst
        self._wall, self._cpu = clocks or (time.monotonic, time.process_time)
        self.tick_seconds = tick_seconds
        self.node_timeout = node_timeout
        self._refusals = refusals
        self.interval = cfg.base_interval
        """How often nodes are told to sync (:func:`pacing.sync_interval`)."""
        self.overloaded: str | None = None
        """Why the coordinator is itself a bottleneck now (None: it is not)."""
        self.overloads = 0
        """Times the coordinator found itself overloaded (a counter)."""
        self.quiet = 0.0
        """No node is called silent before this (the coordinator's clock)."""
        self._delays: deque[float] = deque(maxlen=512)
        self._synced = 0
        self._count = 0   # nodes known (read without the lock for a reply's interval)
        self.callers: int | None = None
        """Calls per sync round while nodes sync through relays (None: one per node)."""
        self._late = 0
        self._late_lock = threading.Lock()
        self._tick = (self._wall(), self._cpu(), 0, 0, 0)   # (wall, cpu, syncs, refused, late) then
        self._last_eval: float | None = None   # time.monotonic() of the last measure()

    def heard(self, delay: float, nodes: int) -> None:
        """A summary arrived ``delay`` s later than its node's best; ``nodes`` are known now.
        (Called under the coordinator's lock, as :meth:`measure` reads these there.)"""
        self._delays.append(delay)
        self._synced += 1
        self._count = nodes

    def answered_late(self) -> None:
        """A sync was answered after its caller's deadline (the caller saw it fail)."""
        with self._late_lock:
            self._late += 1

    def reply_interval(self) -> float:
        """The interval to ask of a node now: never below the floor for the nodes known."""
        return max(self.interval, pacing.interval_floor(self._callers(self._count), self.cfg))

    def _callers(self, nodes: int) -> int:
        callers = self.callers
        return nodes if callers is None else min(nodes, callers)

    def silent(self, now: float, received_at: float, node_interval: float, syncs: int,
               witness: tuple[float, float] | None = None, relayed: bool = False) -> bool:
        """Whether a node last heard at ``received_at`` (told to sync every ``node_interval``
        s, heard ``syncs`` times; ``witness``: its relay's word on it; ``relayed``: heard
        through a relay) has gone silent, as far as this coordinator can tell."""
        if now - received_at <= self.node_timeout:
            return False   # no allowance is shorter (the evaluation asks of every node, 4 times a second)
        return pacing.node_silent(now, received_at, max(node_interval, self.interval), self.node_timeout,
                                       self.quiet, self.cfg, syncs, witness, relayed)

    def measure(self, now: float, lock: threading.Lock, node_intervals: Callable[[], list[float]]) -> None:
        """Measure the load once a window is full; set the interval; hold off silence verdicts
        while overloaded.  ``node_intervals()`` (read under ``lock``) gives the last interval of
        each node summaries are due from (neither dead nor excluded)."""
        wall, cpu = self._wall(), self._cpu()
        lag = 0.0 if self._last_eval is None else max(0.0, wall - self._last_eval - self.tick_seconds)
        self._last_eval = wall
        w0, c0, s0, r0, l0 = self._tick
        if wall - w0 < _WINDOW and lag < self.cfg.lag_seconds:
            return   # a late loop is news at once
        with lock:
            synced = self._synced
            intervals = node_intervals()
            delays = sorted(self._delays)
            self._delays.clear()
        due = sum((wall - w0) / max(i, self.interval) for i in intervals)
        refused = self._refusals()
        with self._late_lock:
            late = self._late
        self._tick = (wall, cpu, synced, refused, late)
        cores = (cpu - c0) / (wall - w0)
        load = pacing.Load(cores=cores, loop_lag=lag,
                                sync_delay=delays[len(delays) // 2] if delays else 0.0,
                                refused=refused - r0, late=late - l0,
                                heard=min(1.0, (synced - s0) / due) if due > 0 else 1.0, nodes=len(intervals))
        interval = max(pacing.sync_interval(self.interval, load, self.cfg),
                       pacing.interval_floor(self._callers(len(intervals)), self.cfg))
        if interval != self.interval:
            log.info("nodes now sync every %.2fs (%d nodes, %.0f syncs/s, %.2f cores)", interval,
                     len(intervals), (synced - s0) / (wall - w0), cores)
            self.interval = interval
        why = pacing.overload(load, self.cfg, self._burst(len(intervals)))
        if why is not None:
            if self.overloaded is None:
                log.warning("coordinator overloaded: %s; no node is called silent until it recovers", why)
            self.overloads += 1
            self.quiet = pacing.quiet_until(now, self.interval, self.node_timeout, self.cfg)
        elif self.overloaded is not None:
            log.info("coordinator load back to normal")
        self.overloaded = why
