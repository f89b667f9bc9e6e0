"""Whether a rank takes peer snapshots, and every how many steps: a pure decision.

Peer snapshots (:mod:`snapshot`) are on by default where they fit.  Every rank of a node
holds its own snapshot and a buddy's copy, about twice its shard bytes, so a node needs
``2 x shard bytes x ranks on the node`` of host memory.  They are on when that fits in the
memory the host has available, less a headroom (:data:`HEADROOM`: a fifth of it, and never
less than :data:`HEADROOM_FLOOR`), for the training's own growth and the rest of the host.

``K`` is the smallest number of steps over which a snapshot's measured cost is at most
:data:`BUDGET` (1 %) of the steps' time, ``K = ceil(cost / (0.01 x step))``, and over which
its exchange is in flight at most :data:`WINDOW` (5 %) of the time, ``K >= ceil(exchange /
(0.05 x step))``, bounded to ``[1, MAX_EVERY]``.  The cost is the step's stall and the
snapshot thread's CPU time (on a CPU machine they compete with the training for its cores).
While an exchange is in flight, a lost node may leave no whole snapshot (the exchange
window, docs/in-process-recovery.md): the second bound keeps a node lost at a random moment
finding one at least 95 % of the time.

Inputs come from outside (the host's memory: :func:`host_memory`; the step and the
snapshot's times: the tier's measurements), so tests drive every branch with numbers.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["BUDGET", "HEADROOM", "HEADROOM_FLOOR", "LIMIT_ENV", "MAX_EVERY", "PROBE_EVERY", "REASONS", "WINDOW",
           "Plan", "StepClock", "every_for", "host_memory", "needs_replan", "plan"]

LIMIT_ENV = "RANKWATCH_SNAPSHOT_MEMORY_LIMIT"
"""Bytes: a cap on the host memory the plan sees (a budget for the snapshots' node, or a
test's "host too small")."""
BUDGET = 0.01
"""The share of the step time a snapshot may cost, spread over its ``K`` steps."""
HEADROOM = 0.2
"""The share of the available memory left free."""
HEADROOM_FLOOR = 512 << 20
"""The least memory left free, whatever the share."""
WINDOW = 0.05
"""The share of the time a snapshot's copy and exchange may be in flight."""
MAX_EVERY = 1000
"""The most steps between snapshots (what a recovery may recompute)."""
PROBE_EVERY = 10
"""``K`` until a snapshot's cost and the step time are measured."""
REPLAN_RATIO = 2.0
"""The step time changed by more than this factor, either way: ``K`` is chosen again."""

REASONS = ("fits", "override", "disabled", "memory", "single_node", "replicas", "measuring")
"""Why the plan is what it is (the metric's ``reason`` label; a small fixed set):
``fits`` on, sized from the measured times; ``measuring`` on at :data:`PROBE_EVERY` until
they are measured; ``override`` on at the user's ``K``; ``disabled`` off by the user;
``memory`` off, the memory needed exceeds a node's budget; ``single_node`` off, no other
node to hold a copy; ``replicas`` off, whole replicas on nodes already hold every shard twice."""


@dataclass(frozen=True)
class Plan:
    """What the rank does: snapshots on or off, every how many steps, and why."""

    on: bool
    every: int
    """Steps between snapshots (0 when off)."""
    reason: str
    """One of :data:`REASONS`."""
    detail: str
    """One line for the log: the figures behind the plan, and what would change it."""

    @property
    def reason_code(self) -> int:
        """:attr:`reason`'s index in :data:`REASONS` (the wire carries it as a number)."""
        return REASONS.index(self.reason)


def plan(*, shard_bytes: int, ranks_on_host: int, available_bytes: int | None, limit_bytes: int | None = None,
         cost_seconds: float | None = None, step_seconds: float | None = None, override: int | None = None,
         nodes: int = 2, replicas: bool = False, exchange_seconds: float = 0.0) -> Plan:
    """The plan for one rank.

    Args:
        shard_bytes: this rank's own snapshot (its shards and optimizer state).
        ranks_on_host: the node's ranks (``LOCAL_WORLD_SIZE``), which all take snapshots.
        available_bytes: the memory the host has available (None: unknown, assumed to fit).
        limit_bytes: a cap on it (a cgroup's room, :data:`LIMIT_ENV`), or None.
        cost_seconds: a snapshot's measured copy and exchange, or None before one was taken.
        step_seconds: the step time now (a robust median), or None before it was measured.
        override: None: decide; 0: off; ``K > 0``: every ``K`` steps, whatever the memory.
        nodes: the job's nodes (a copy goes to another node; one node has none).
        replicas: the job has whole replicas on nodes (every shard lies on two nodes already).
        exchange_seconds: a snapshot's copy and exchange, start to end (the exchange window).
    """
    if override == 0:
        return Plan(False, 0, "disabled", "peer snapshots are off (--snapshot-every off); "
                                          "without the flag they are on where the memory allows")
    if override is not None and override > 0:
        return Plan(True, override, "override", f"peer snapshots every {override} steps (--snapshot-every)")
    if nodes < 2:
        return Plan(False, 0, "single_node", "peer snapshots are off: the job has one node, so no other node "
                                             "could hold a copy; they turn on for a job over several nodes")
    if replicas:
        return Plan(False, 0, "replicas", "peer snapshots are off: whole replicas on nodes hold every shard "
                                          "twice already; --snapshot-every K turns them on anyway")
    need = 2 * max(0, shard_bytes) * max(1, ranks_on_host)
    room = _room(available_bytes, limit_bytes)
    if room is not None and need > room:
        return Plan(False, 0, "memory", f"peer snapshots are off: the node's {max(1, ranks_on_host)} rank(s) "
                    f"need {_gib(need)} (own copy and a buddy's, {_gib(shard_bytes)} each), and the host leaves "
                    f"{_gib(room)} of {_gib(_seen(available_bytes, limit_bytes))} available after headroom; "
                    f"more memory, fewer ranks per node, or --snapshot-every K turns them on")
    fits = f"{_gib(need)} for the node's {max(1, ranks_on_host)} rank(s) of {_gib(room)} free after headroom" \
        if room is not None else f"{_gib(need)} for the node's ranks (host memory unknown)"
    if cost_seconds is None or not step_seconds or step_seconds <= 0:
        return Plan(True, PROBE_EVERY, "measuring", f"peer snapshots on ({fits}), every {PROBE_EVERY} steps "
                                                    "until a snapshot and the steps are timed")
    k = max(every_for(cost_seconds, step_seconds), every_for(exchange_seconds, step_seconds, WINDOW))
    return Plan(True, k, "fits", f"peer snapshots every {k} steps ({fits}): a snapshot costs "
                f"{cost_seconds * 1e3:.1f} ms, {100 * cost_seconds / (k * step_seconds):.2f} % of {k} steps of "
                f"{step_seconds * 1e3:.1f} ms, its exchange in flight {exchange_seconds * 1e3:.0f} ms of them")


def every_for(seconds: float, step_seconds: float, share: float = BUDGET) -> int:
    """The fewest steps over which ``seconds`` is at most ``share`` of their time."""
    if step_seconds <= 0 or not math.isfinite(step_seconds) or not math.isfinite(seconds):
        return MAX_EVERY
    k = math.ceil(max(0.0, seconds) / (share * step_seconds) - 1e-9)
    return min(MAX_EVERY, max(1, k))


def needs_replan(planned_step_seconds: float | None, step_seconds: float | None) -> bool:
    """True when the step time moved by more than :data:`REPLAN_RATIO` either way since the plan."""
    if not planned_step_seconds or not step_seconds or planned_step_seconds <= 0 or step_seconds <= 0:
        return bool(step_seconds) and not planned_step_seconds
    ratio = step_seconds / planned_step_seconds
    return ratio > REPLAN_RATIO or ratio < 1 / REPLAN_RATIO


def _room(available: int | None, limit: int | None) -> int | None:
    """The bytes the snapshots may take: what is available (capped), less the headroom."""
    seen = _seen(available, limit)
    if seen is None:
        return None
    return max(0, seen - max(int(seen * HEADROOM), HEADROOM_FLOOR))


def _seen(available: int | None, limit: int | None) -> int | None:
    known = [v for v in (available, limit) if v is not None]
    return min(known) if known else None


def _gib(n: int | None) -> str:
    if n is None:
        return "?"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def host_memory(env: Mapping[str, str], proc: Path = Path("/proc"),
                cgroup: Path = Path("/sys/fs/cgroup")) -> tuple[int | None, int | None]:
    """(the host's available memory, a cap on it or None): ``MemAvailable`` from meminfo; the
    cap is the least of the cgroup's room (``memory.max`` less ``memory.current``, cgroup v2)
    and :data:`LIMIT_ENV`.  Unreadable sources count as absent."""
    available = _meminfo_available(proc / "meminfo")
    caps = [c for c in (_cgroup_room(_own_cgroup(proc, cgroup)), _env_limit(env)) if c is not None]
    return available, (min(caps) if caps else None)


def _meminfo_available(path: Path) -> int | None:
    try:
        for line in path.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _own_cgroup(proc: Path, root: Path) -> Path:
    """This process's cgroup (v2) directory under ``root``, or ``root``."""
    try:
        for line in (proc / "self" / "cgroup").read_text().splitlines():
            if line.startswith("0::"):
                own = root / line[3:].strip().lstrip("/")
                return own if (own / "memory.max").exists() else root
    except OSError:
        pass
    return root


def _cgroup_room(root: Path) -> int | None:
    try:
        limit = (root / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((root / "memory.current").read_text().strip()))
    except (OSError, ValueError):
        return None


def _env_limit(env: Mapping[str, str]) -> int | None:
    raw = env.get(LIMIT_ENV, "").strip()
    try:
        return max(0, int(float(raw))) if raw else None
    except ValueError:
        return None


class StepClock:
    """The step time as a robust median of the last ``window`` step periods."""

    def __init__(self, window: int = 21) -> None:
        self._periods: deque[float] = deque(maxlen=window)
        self._last: float | None = None

    def tick(self, now: float) -> None:
        """A step ended at ``now`` (seconds, any monotonic clock)."""
        if self._last is not None and now > self._last:
            self._periods.append(now - self._last)
        self._last = now

    def restart(self) -> None:
        """A pause that is not a step (a recovery): the next tick starts a period."""
        self._last = None

    def median(self, least: int = 5) -> float | None:
        """The median period, once ``least`` are known."""
        return statistics.median(self._periods) if len(self._periods) >= least else None

    def extend(self, periods: Iterable[float]) -> None:
        self._periods.extend(periods)
