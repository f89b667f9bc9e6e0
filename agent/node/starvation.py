"""CPU starvation of a rank's critical threads: time they were runnable but not running.

A rank whose host is saturated (more runnable threads than cores, a noisy
neighbour, an agent or data-loader process hogging the CPU) spends part of
each step waiting on the kernel's run queue.  Linux accounts that per thread
as ``run_delay`` (the second field of ``/proc/<pid>/task/<tid>/schedstat``,
nanoseconds, kept whenever the kernel has ``CONFIG_SCHED_INFO``).

The threads read are the ones a step waits for: the thread-group leader,
which in a torchrun worker is the training thread, and the threads that run
gloo's collectives (named ``gloo*`` and ``pt_gloo*``), which the training
thread waits on inside each collective.  Other threads (an intra-op pool, the
hooks' sender) are not on the step's path, and their waits are not the job's.
Time a thread sleeps, waits on I/O or a GPU, or spends SIGSTOPped is not run
delay, so only CPU starvation counts.

The agent samples it for its own ranks and spreads each sample's increase
evenly over the steps completed since the previous one, giving per-step
starvation seconds next to each rank's per-step own work: the training
thread's, which tells a starved host from slow compute (it is inside the own
work), and the collective threads' together, which is what a starved rank
costs the others inside their collectives.  Threads are
compared with themselves between samples: one that ended or began between
two samples adds nothing to that sample's share.
"""

from __future__ import annotations

import os
from collections import deque
from pathlib import Path

__all__ = ["CRITICAL_THREADS", "StarvationTracker", "critical_run_delays"]

# Name prefixes of the threads that run a rank's gloo collectives.
CRITICAL_THREADS = ("gloo", "pt_gloo")


def critical_run_delays(pid: int, proc: Path = Path("/proc"),
                        names: dict[int, str] | None = None) -> dict[int, float] | None:
    """Run delay (seconds) of each of ``pid``'s critical threads by thread id, or None if
    the process is gone or unreadable.

    ``names`` caches thread id -> name between calls (a thread's name is read once)."""
    task = proc / str(pid) / "task"
    try:
        tids = [int(t) for t in os.listdir(task)]
    except (OSError, ValueError):
        return None
    names = {} if names is None else names
    for gone in set(names) - set(tids):
        del names[gone]
    out: dict[int, float] = {}
    for tid in tids:
        if tid not in names:
            try:
                names[tid] = (task / str(tid) / "comm").read_text().strip()
            except OSError:
                continue   # a thread that just ended
        if tid == pid or names[tid].startswith(CRITICAL_THREADS):
            delay = _schedstat_delay(task / str(tid) / "schedstat")
            if delay is not None:
                out[tid] = delay
    return out if pid in out else None


def _schedstat_delay(path: Path) -> float | None:
    try:
        return int(path.read_text().split()[1]) * 1e-9
    except (OSError, IndexError, ValueError):
        return None


class StarvationTracker:
    """Per-rank, per-step run delay of the ranks' training threads and collective threads.

    Args:
        maxlen: steps kept per rank (match the agent's own-work window).
        proc: the proc file system (tests point it at fixtures).
    """

    def __init__(self, maxlen: int = 64, proc: Path = Path("/proc")) -> None:
        self._maxlen = maxlen
        self._proc = proc
        # rank -> (pid, steps completed, run delay by thread) at the last sample
        self._last: dict[int, tuple[int, int, dict[int, float]]] = {}
        self._names: dict[int, dict[int, str]] = {}   # rank -> its threads' names
        # rank -> per step: (the training thread's, its collective threads' together)
        self._per_step: dict[int, tuple[deque[float], deque[float]]] = {}

    def sample(self, rank: int, pid: int, completed: int) -> None:
        """Read ``pid``'s critical threads' run delay now, with ``completed`` steps done so far."""
        last = self._last.get(rank)
        if last is None or last[0] != pid:
            self._names[rank] = {}
        delays = critical_run_delays(pid, self._proc, self._names[rank])
        if delays is None:
            self._last.pop(rank, None)  # gone or unreadable: keep what was measured
            return
        self._last[rank] = (pid, completed, delays)
        if last is None or last[0] != pid or completed < last[1]:
            self._per_step[rank] = (deque(maxlen=self._maxlen), deque(maxlen=self._maxlen))
            return
        steps = completed - last[1]
        if steps > 0:
            grown = {tid: max(0.0, d - last[2][tid]) for tid, d in delays.items() if tid in last[2]}
            main = grown.pop(pid, 0.0)
            n = min(steps, self._maxlen)
            ours, theirs = self._per_step[rank]
            ours.extend([main / steps] * n)
            theirs.extend([sum(grown.values()) / steps] * n)
        else:
            # No step finished: carry the delay into the next sample's share.
            self._last[rank] = last

    def per_step(self, rank: int) -> list[float] | None:
        """The rank's training thread's recent per-step run delay (oldest first), or None if
        never sampled."""
        steps = self._per_step.get(rank)
        return list(steps[0]) if steps and steps[0] else None

    def collective_per_step(self, rank: int) -> list[float] | None:
        """Its collective threads' recent per-step run delay, together (as :meth:`per_step`)."""
        steps = self._per_step.get(rank)
        return list(steps[1]) if steps and steps[1] else None

    def retain(self, ranks: set[int]) -> None:
        """Forget every rank but ``ranks`` (the node's ranks now): what it keeps stays bounded
        by the ranks the node has, however many rank ids came and went."""
        for rank in set(self._last) | set(self._per_step) | set(self._names):
            if rank not in ranks:
                self.forget(rank)

    def forget(self, rank: int) -> None:
        self._last.pop(rank, None)
        self._names.pop(rank, None)
        self._per_step.pop(rank, None)
