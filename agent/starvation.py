"""CPU starvation of a rank's training thread: time it was runnable but not running.

A rank whose host is saturated (more runnable threads than cores, a noisy
neighbour, an agent or data-loader process hogging the CPU) spends part of
each step waiting on the kernel's run queue.  Linux accounts that per thread
as ``run_delay`` (the second field of ``/proc/<pid>/schedstat``, nanoseconds,
kept whenever the kernel has ``CONFIG_SCHED_INFO``).  ``/proc/<pid>/schedstat``
is the thread-group leader's, which in a torchrun worker is the main thread:
the training thread.  Time the thread sleeps, waits on I/O or a GPU, or spends
SIGSTOPped is not run delay, so only CPU starvation counts.

The agent samples it for its own ranks and spreads each sample's increase
evenly over the steps completed since the previous one, giving per-step
starvation seconds next to each rank's per-step own work.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path

__all__ = ["StarvationTracker", "run_delay_seconds"]


def run_delay_seconds(pid: int, proc: Path = Path("/proc")) -> float | None:
    """Seconds the process's main thread has waited on a run queue, or None if unknown."""
    try:
        fields = (proc / str(pid) / "schedstat").read_text().split()
        return int(fields[1]) * 1e-9
    except (OSError, IndexError, ValueError):
        return None


class StarvationTracker:
    """Per-rank, per-step run delay of the ranks' training threads.

    Args:
        maxlen: steps kept per rank (match the agent's own-work window).
        proc: the proc file system (tests point it at fixtures).
    """

    def __init__(self, maxlen: int = 64, proc: Path = Path("/proc")) -> None:
        self._maxlen = maxlen
        self._proc = proc
        # rank -> (pid, steps completed, run delay) at the last sample
        self._last: dict[int, tuple[int, int, float]] = {}
        self._per_step: dict[int, deque[float]] = {}

    def sample(self, rank: int, pid: int, completed: int) -> None:
        """Read ``pid``'s run delay now, with ``completed`` steps done so far."""
        delay = run_delay_seconds(pid, self._proc)
        if delay is None:
            self._last.pop(rank, None)  # gone or unreadable: keep what was measured
            return
        last = self._last.get(rank)
        self._last[rank] = (pid, completed, delay)
        if last is None or last[0] != pid or completed < last[1]:
            self._per_step[rank] = deque(maxlen=self._maxlen)
            return
        steps = completed - last[1]
        if steps > 0:
            share = max(0.0, delay - last[2]) / steps
            self._per_step[rank].extend([share] * min(steps, self._maxlen))
        else:
            # No step finished: carry the delay into the next sample's share.
            self._last[rank] = last

    def per_step(self, rank: int) -> list[float] | None:
        """The rank's recent per-step run delay (oldest first), or None if never sampled."""
        steps = self._per_step.get(rank)
        return list(steps) if steps else None

    def forget(self, rank: int) -> None:
        self._last.pop(rank, None)
        self._per_step.pop(rank, None)
