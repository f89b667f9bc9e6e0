"""The node's ranks as the detectors read them: each rank's progress, windows and fresh
evidence copied under the node's lock (:func:`snapshot`), and whether its process lives or is
stopped (:func:`process_state`).  What the detectors make of it is :mod:`.sweep`'s.
"""

from __future__ import annotations

import psutil

from rankwatch.agent.detect.evaluate import STACKS_FRESH_SECONDS, Snapshot
from rankwatch.agent.detect.hang_verdict import RankProgress
from rankwatch.agent.node.intake import NodeState

__all__ = ["process_state", "snapshot"]


def process_state(pid: int) -> tuple[bool, bool]:
    """(alive, stopped) of a local process."""
    try:
        status = psutil.Process(pid).status()
    except psutil.Error:
        return False, False
    if status == psutil.STATUS_ZOMBIE:
        return False, False
    return True, status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)


def snapshot(state: NodeState, now: float) -> Snapshot:
    """The node's ranks as :func:`evaluate` reads them (windows copied under the lock)."""
    with state.lock:
        rows = [(r, dict(r.group_seqs), r.inflight, list(r.own_work), list(r.data_wait), list(r.comm_wait))
                for r in state.ranks.values()]
    views = []
    for r, seqs, inflight, own, data, wait in rows:
        fresh = now - r.stacks_at < STACKS_FRESH_SECONDS
        alive, stopped = process_state(r.pid)
        views.append(RankProgress(
            rank=r.rank, node=r.node, step=r.step, step_seconds=r.step_seconds,
            steps_completed=r.steps_completed, activity=r.activity, progress_at=r.progress_at,
            last_seen=r.last_seen, connected=r.connected, exited_cleanly=r.exited_cleanly,
            group_seqs=seqs, inflight=inflight, stacks=r.stacks if fresh and r.stacks else None,
            flight_recorder=r.flight_recorder if fresh else None, pid=r.pid, alive=alive,
            stopped=stopped, own=own, data=data, wait=wait, role=int(r.mesh_coords.get("pp", 0))))
    return Snapshot(ranks=views, scope="node")
