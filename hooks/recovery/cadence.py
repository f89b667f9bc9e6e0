"""When the in-process tier takes peer snapshots: the plan (:mod:`budget`), agreed by
every rank, and the steps it names.

Every rank must snapshot at the same steps (each exchange pairs a rank with its buddy), so
the ranks agree on the plan in one all-reduce of four numbers over the world, at a world's
first step (the start, each recovery's new world, a joiner's first) and every
:data:`AGREE_EVERY` steps after: off if any rank's node lacks the memory, else the largest
``K`` any rank asks for.  Snapshots are then taken at the steps that ``K`` divides.  The
first ``K`` is :data:`~rankwatch.hooks.recovery.budget.PROBE_EVERY`; from the next
agreement on, it is sized from the snapshots' measured cost and the step time, and sized
again when the step time moves by more than 2x.  With ``--snapshot-every K`` (a fixed ``K``)
or off, nothing is agreed: every rank has the same flag.

The plan is logged once (and each time ``K`` changes) and reported with the snapshots'
stats (``rankwatch_snapshot_*`` on the agent's /metrics).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Any

from rankwatch.hooks.recovery import report
from rankwatch.hooks.recovery.decide import Job
from rankwatch.hooks.recovery.snapshot import PeerSnapshots
from rankwatch.hooks.recovery.shard_buffer import layout
from rankwatch.hooks.recovery.budget import REASONS, Plan, StepClock, host_memory, needs_replan, plan

__all__ = ["AGREE_EVERY", "SnapshotSchedule"]

log = logging.getLogger(__name__)

AGREE_EVERY = 20
"""Steps between the ranks' agreements on the plan (one small all-reduce each)."""


class SnapshotSchedule:
    """Args:
        every: None: decide (on where the memory allows, ``K`` sized); 0: off; ``K > 0``:
            every ``K`` steps.
        device: the job's device type (``cuda``: the agreement's tensor lives there).
        env: the environment (``LOCAL_WORLD_SIZE``, the memory limit).
    """

    def __init__(self, every: int | None, device: str = "cpu", env: Mapping[str, str] = os.environ) -> None:
        if every is not None and every < 0:
            raise ValueError(f"snapshot every {every} steps: must be >= 0 (None decides)")
        self._override = every
        self._device = device
        self._env = env
        self.snapshots = PeerSnapshots(every or 0, device) if every != 0 else None
        self.plan: Plan | None = None
        self._clock = StepClock()
        self._planned_step: float | None = None   # the step time the current K was sized for
        self._fresh = True   # a new world: agree at its first step
        self._memory: tuple[int | None, int | None] | None = None   # read once
        self._said: tuple | None = None

    def regroup(self, members: tuple[int, ...], node: str) -> None:
        """A new world (collective, as :meth:`PeerSnapshots.regroup`): agree at its first step."""
        if self.snapshots is not None:
            self.snapshots.regroup(members, node)
        self._fresh = True
        self._clock.restart()

    def stepped(self, job: Job | None, step: int, monitor: Any) -> None:
        """After each completed step (every rank): agree when due, and take a snapshot when due."""
        self._clock.tick(time.perf_counter())
        if self._override is not None:
            if self.plan is None:
                self._settle(plan(shard_bytes=0, ranks_on_host=1, available_bytes=None, override=self._override),
                             monitor)
        elif job is not None and (self._fresh or step % AGREE_EVERY == 0):
            self._fresh = False
            self._settle(self._agree(job), monitor)
        p, snaps = self.plan, self.snapshots
        if p is not None and p.on and snaps is not None and job is not None and step > 0 and step % p.every == 0:
            self._stamp(snaps.take(job, step, background=True))
            report.snapshot(monitor, snaps.stats)

    def _local(self, job: Job) -> Plan:
        """This rank's own plan, from its measurements (kept while the step time holds)."""
        import torch.distributed as dist

        snaps = self.snapshots
        assert snaps is not None
        step, kept = self._clock.median(), self.plan
        if kept is not None and kept.reason == "fits" and not needs_replan(self._planned_step, step):
            return kept
        if self._memory is None:
            self._memory = host_memory(self._env)
        cost = snaps.stats.cost_seconds if snaps.stats.step >= 0 and snaps.wait(0) else None
        local = plan(shard_bytes=layout(job)[1], ranks_on_host=int(self._env.get("LOCAL_WORLD_SIZE", "1")),
                     available_bytes=self._memory[0], limit_bytes=self._memory[1],
                     cost_seconds=cost, step_seconds=step, nodes=snaps.nodes,
                     replicas=job.replica_size < dist.get_world_size(), exchange_seconds=snaps.stats.window_seconds)
        if local.reason == "fits":
            self._planned_step = step
        return local

    def _agree(self, job: Job) -> Plan:
        """Every rank's plan made one: off where any is off, else the largest ``K``."""
        import torch
        import torch.distributed as dist

        mine = self._local(job)
        dev = f"cuda:{torch.cuda.current_device()}" if self._device == "cuda" else "cpu"
        votes = torch.tensor([0 if mine.on else 1, mine.every, 0 if mine.on else mine.reason_code + 1,
                              mine.reason_code + 1 if mine.on else 0], dtype=torch.int64, device=dev)
        dist.all_reduce(votes, op=dist.ReduceOp.MAX)
        off, every, off_reason, on_reason = (int(v) for v in votes.tolist())
        reason = REASONS[(off_reason if off else on_reason) - 1]
        if reason == mine.reason and (off or every == mine.every):
            return mine
        if off:
            return Plan(False, 0, reason, f"peer snapshots are off: another rank's plan says {reason!r} "
                                          f"(this rank's: {mine.detail})")
        return Plan(True, every, reason, f"peer snapshots every {every} steps, the most any rank asked for "
                                         f"(this rank's plan: {mine.detail})")

    def _settle(self, p: Plan, monitor: Any) -> None:
        """Adopt ``p``; log it once (and whenever it changes) and report it."""
        self.plan = p
        said = (p.on, p.every, p.reason)
        if said != self._said:
            self._said = said
            log.warning("rankwatch: %s", p.detail)
        stats = self.snapshots.stats if self.snapshots is not None else None
        if stats is None:
            from rankwatch.hooks.recovery.snapshot import Stats

            stats = Stats()
        self._stamp(stats)
        report.snapshot(monitor, stats)

    def _stamp(self, stats: Any) -> Any:
        if self.plan is not None:
            stats.every, stats.reason = (self.plan.every if self.plan.on else 0), self.plan.reason_code
        return stats
