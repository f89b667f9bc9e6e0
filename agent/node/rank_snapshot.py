"""The node's ranks as the detectors read them: each rank's progress, windows and fresh
evidence copied under the node's lock (:func:`snapshot`), whether its process lives or is
stopped (:func:`process_state`), and the GPUs they use as the GPU monitor reads them
(:func:`rank_devices`).  What the detectors make of it is :mod:`.sweep`'s.
"""

from __future__ import annotations

import psutil

from rankwatch.agent.detect.evaluate import STACKS_FRESH_SECONDS, Snapshot
from rankwatch.agent.detect.hang_verdict import RankProgress
from rankwatch.agent.gpu import RankDevice
from rankwatch.agent.node.intake import NodeState, RankState

__all__ = ["device_of", "process_state", "rank_devices", "snapshot"]

RECENT_SECONDS = 60.0   # a rank gone this long ago may still have been killed by its GPU's fault


def device_of(r: RankState) -> RankDevice:
    return RankDevice(r.rank, r.device, r.local_rank, r.step, r.device_uuid)


def rank_devices(state: NodeState) -> list[RankDevice]:
    """The node's ranks that are streaming, or were in the last minute (a GPU fault may kill them)."""
    now = state.clock()
    return [device_of(r) for r in state.snapshot() if r.connected or now - r.last_seen < RECENT_SECONDS]


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
