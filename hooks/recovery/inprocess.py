"""In-process recovery: the workers that survive a node's loss train on, without exiting.

torchrun's answer to a lost node is to stop every worker and start new ones: new
Python processes, torch imported again, the model wrapped again, the state read from
disk.  This tier keeps the survivors' processes and their state in memory:

1. **Leave the failed step**: NCCL aborts; on gloo the survivor whose collective failed
   shuts its own connections of the failed groups (:mod:`net`), which breaks its
   neighbours' pending collectives in turn; every worker's watch (:mod:`breakout`) breaks
   out one the chain missed.  (A hung peer breaks nothing: the groups' timeout bounds it.)
2. **Agree** on the new membership in the recovery store (:mod:`store`), under a fresh
   prefix per generation: the first survivor to arrive decides (the pure function
   :func:`~rankwatch.hooks.recovery.decide.decide`) once every member arrived or is proven
   gone (its liveness port refuses connections), or after ``settle`` seconds.
3. **Re-initialise** the default process group among the survivors and call the user's
   ``make(membership)`` for the new world, exactly as at the start.
4. **Restore** each survivor's own shards from memory: whole replicas on nodes (a lost node
   takes whole replicas with it); a survivor at another step than the newest whole
   replica's takes that replica's state (:mod:`state`).

**Joining** (a spare, a returning node, a hot spare standing by): :mod:`joins`.

Whatever cannot be done in process (a partial node, a broken replica, no replica whole at
one step) fails the attempt on every survivor: :class:`RecoveryFailed` is raised, the
workers exit, and torchrun's restart recovers the job as before.

**Without whole replicas** (plain FSDP2 over every rank): peer snapshots, on by default where
the memory allows (:mod:`cadence`), every ``K`` steps send each rank's shards to a
buddy on another node; the survivors go on from the snapshot's step (:mod:`reshard`), or
from the newest complete checkpoint, loaded in process (``reload``, :mod:`rebuild`).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from rankwatch.hooks.recovery import net, rebuild, report
from rankwatch.hooks.recovery.breakout import BreakWatch, leave_step
from rankwatch.hooks.recovery.decide import MAX_MESSAGE, Decision, Job, Membership, decide
from rankwatch.hooks.recovery.commit import StepCommit
from rankwatch.hooks.recovery.failure import is_peer_failure
from rankwatch.hooks.recovery.joins import JoinWatch, warm_up
from rankwatch.hooks.recovery.protocol import JobFinished, RecoveryFailed, Round
from rankwatch.hooks.recovery.cadence import SnapshotSchedule
from rankwatch.hooks.recovery.state import local_state
from rankwatch.hooks.recovery.store import JOIN_ENV, STANDBY_ENV, connect

__all__ = ["Decision", "InProcessRecovery", "Job", "JobFinished", "Membership", "RecoveryFailed", "decide",
           "is_peer_failure"]

log = logging.getLogger(__name__)


_STANDBY_WAIT = 30 * 24 * 3600.0   # a standby worker waits for a loss as long as the job runs


class InProcessRecovery:
    """Args:
        make: builds the job for a membership; called after the default process group
            exists, by every member, with the same arguments.
        backend: the process groups' backend (``gloo``, ``nccl``).
        monitor: a rankwatch Monitor (its ``recovered`` reports each attempt), or None.
        settle: seconds the agreement waits for a member that neither arrived nor is proven
            gone (a hung process, a host that is down).
        timeout: the process groups' timeout: how long a collective waits for a hung peer.
        max_recoveries: in-process recoveries before the tier leaves it to torchrun.
        join_timeout: seconds a joining worker waits to be admitted.
        commit: before each optimizer step, agree in one all-reduce of one element over the
            world (an optimizer step pre-hook on ``job.optimizer``), so that every rank
            applies a step or none does.  Without it, a worker lost in the middle of a step
            (its node's other workers live on a moment) can leave some of the survivors'
            shards a step ahead of the others', and then no replica is whole at one step.
        total_steps: the loop's last step, if known: no joiner is let in after it (the
            survivors' next collectives are then the job's own end, not a step a joiner
            could break); :meth:`finish` tells the ones still waiting that the job finished.
        drain: called on rank 0 before it leaves a healthy step to admit joiners, to finish
            the work in flight on the process groups that the break would cut (an
            asynchronous checkpoint save: ``Checkpointer.wait``).  A lost peer's failure
            cuts such work whatever is done; a break the job chose need not.
        snapshot_every: peer snapshots (:mod:`snapshot`) every this many steps: a job without
            whole replicas on nodes recovers a lost node from them (:mod:`reshard`), from the
            snapshot's step.  None (the default): on where the host's memory allows, ``K``
            sized to cost at most 1 % of the steps (:mod:`cadence`).  0: none.
        reload: loads the newest complete checkpoint into a job built for the new world
            (collective; DCP reshards) and returns its step, for when neither a replica
            nor a peer snapshot holds a lost rank's shards.  None: torchrun's restart then.
    """

    def __init__(self, make: Callable[[Membership], Job], *, backend: str = "gloo", monitor: Any = None,
                 settle: float = 1.0, timeout: datetime.timedelta = datetime.timedelta(minutes=30),
                 max_recoveries: int = 8, join_timeout: float = 600.0, commit: bool = True,
                 total_steps: int | None = None, drain: Callable[[], object] | None = None,
                 snapshot_every: int | None = None, reload: rebuild.Reload | None = None,
                 env: Mapping[str, str] = os.environ) -> None:
        if backend == "nccl":
            net.nccl_errors_to_caller()
        self._make = make
        self._schedule = SnapshotSchedule(snapshot_every, "cuda" if backend == "nccl" else "cpu", env)
        self.snapshots = self._schedule.snapshots
        self._job: Job | None = None   # the job the snapshots are taken of
        self._reload = reload
        self._drain = drain
        self._total_steps = total_steps
        self._commit = StepCommit(backend) if commit else None
        self._backend = backend
        self._monitor = monitor
        self._settle = settle
        self._timeout = timeout
        self._max = max_recoveries
        self._join_timeout = join_timeout
        self._env = env
        self._round: Round | None = None
        self._joins: JoinWatch | None = None   # with a store: rank 0's watch for joiners
        self._breaks: BreakWatch | None = None  # with a store: breaks this worker out of a step others left
        self._baseline: set[tuple] = set()
        self._excluded_endpoints: set[tuple[str, int]] = set()
        self.membership: Membership | None = None
        self.completed = 0
        """The steps the job had applied when this worker's tier started: 0, or, for a
        joiner, the step the survivors admitted it at (its loop goes on from there)."""
        self._report: dict[str, Any] | None = None
        self._liveness: net.Liveness | None = None
        self._breaking = False
        self._regain: tuple[int, float] | None = None   # (the step a recovery cut short, when it was caught)

    # -- the start ------------------------------------------------------------------
    def start(self) -> Job:
        """Join the default process group (collective) and build the job for generation 0;
        a joining worker instead waits to be admitted by the survivors (see the module)."""
        import torch.distributed as dist

        try:
            self._round = Round(*connect(self._env), self._env, self._settle)
            self._joins = JoinWatch(self._round, self._env, self._total_steps)
            self._excluded_endpoints = net.store_endpoints(self._env)
        except Exception as exc:  # noqa: BLE001 - training goes on; only this tier is off
            if self._env.get(JOIN_ENV):
                raise RecoveryFailed(f"a joining worker needs the recovery store: {exc}") from exc
            log.warning("rankwatch: in-process recovery is off: no recovery store (%s)", exc)
            self._round = self._joins = None
        # Connections opened from here on are the process groups' (and the worker store's,
        # used only to create them): a failure shuts them.
        self._baseline = net.tcp_sockets()
        if self._round is not None:
            self._breaks = BreakWatch(self._round, self._env, self._leave_own)
        if self._joins is not None and self._env.get(JOIN_ENV):
            job = self._join()
            self._joins.start()
            return job
        if not dist.is_initialized():
            dist.init_process_group(self._backend, timeout=self._timeout)
        rank, world = dist.get_rank(), dist.get_world_size()
        self.membership = Membership(generation=0, rank=rank, world_size=world, members=tuple(range(world)))
        if self._round is not None:
            self._liveness = net.Liveness()
            self._round.register(rank, world, self._liveness.address)
        job = self._build(self.membership)
        if self._joins is not None and self._breaks is not None:
            self._joins.follow(rank, job.replica_size)
            self._joins.start()
            self._breaks.follow(0)
            self._breaks.start()
        return job

    # -- the hot path ---------------------------------------------------------------
    def stepped(self, step: int) -> dict[str, float] | None:
        """Call after each completed step.  After a recovery's first step, reports the
        recovery and returns its phases; else None.  On rank 0, with workers waiting to
        join, leaves the step here so that every survivor admits them (see the module)."""
        phases = self._finish_report(step) if self._report is not None else None
        if self._regain is not None and step >= self._regain[0]:
            log.warning("rankwatch: regained step %d %.3f s after the failure (at %.3f)", step,
                        time.time() - self._regain[1], time.time())
            self._regain = None
        self._schedule.stepped(self._job, step, self._monitor)
        if self._joins is not None and self._joins.due(step):
            log.warning("rankwatch: leaving the training after step %d to admit joining workers", step)
            if self._drain is not None:   # the break shuts every group's connections, its own too
                self._drain()
            self._breaking = True
            log.debug("rankwatch: shut %d connection(s) to admit joiners", self._leave())
            if self.membership is not None and self.membership.world_size == 1:
                raise RuntimeError("rankwatch: leaving the step to admit joining workers")  # no collective would fail
        return phases

    def carry(self, values: Any) -> bool:
        """Call before ``job.optimizer.step()`` with numbers your loop sums over the world
        every step anyway (a 1-element tensor of its loss for the log, a token count; on the
        commit's device): the step's commit sums them in its own all-reduce, in place, so
        the tier adds no collective to the step.  False: no commit runs (the tier is off,
        or ``commit=False``); sum them yourself."""
        return self._commit is not None and self._commit.carry(values)

    def _build(self, membership: Membership) -> Job:
        """``make(membership)``, with the commit before each optimizer step."""
        # collective: the snapshots' own group, the buddies
        self._schedule.regroup(membership.members, self._round.node if self._round else "")
        job = self._job = self._make(membership)
        if self._commit is None or self._round is None:   # without a store no recovery needs it
            return job
        self._commit.attach(job.optimizer)
        return job

    # -- a failure ------------------------------------------------------------------
    def recover(self, exc: BaseException, job: Job, completed: int) -> tuple[Job, int]:
        """Recover from ``exc`` in process and return the new job and the step to go on from.

        Raises ``exc`` itself when it is not a lost peer, and :class:`RecoveryFailed` when
        the survivors cannot go on in process (then the worker should exit, so that
        torchrun restarts it).
        """
        breaking, self._breaking = self._breaking, False
        # Not a hang while it lasts: the agent gives a recovery its own, longer allowance.
        with (report.activity(self._monitor, "recovery"),
              self._joins.paused() if self._joins else contextlib.nullcontext()):
            return self._recover(exc, job, completed, breaking)

    def _recover(self, exc: BaseException, job: Job, completed: int, breaking: bool) -> tuple[Job, int]:
        """An attempt in named steps: leave the failed step, agree on the new world, rebuild it,
        report.  Any failure is reported and raised as :class:`RecoveryFailed`."""
        if not breaking and not is_peer_failure(exc):
            raise exc
        caught, t0 = time.time(), time.perf_counter()
        phases: dict[str, float] = {}
        shut = 0 if breaking else self._leave()
        ready = self._commit is not None and self._commit.failed_inside() and not breaking
        assert self.membership is not None
        old = self.membership
        log.warning("rankwatch: rank %d: a collective failed at step %d (%s); shut %d connection(s) of "
                    "the failed groups; recovering in process", old.rank, completed + 1,
                    "admitting joiners" if breaking else str(exc).splitlines()[0][:MAX_MESSAGE], shut)
        try:
            completed = self._applied(old, completed)
            decision, shards = self._agree(old, job, completed, breaking, ready, phases, t0)
            new, shards = self._placed(old, decision, job, completed, shards)
            phases["reinitialised"] = time.perf_counter() - t0   # overwritten once done
            self._init_group(new)
            job = self._build(new)
            phases["reinitialised"] = time.perf_counter() - t0
            step = rebuild.put_back(job, decision, new.rank, shards, self.snapshots, self._reload, phases, t0)
        except Exception as failure:  # noqa: BLE001 - reported, then torchrun's restart takes over
            mark = self._round.mark_restarting if self._round is not None and "reinitialised" in phases else None
            raised = report.failed(self._monitor, failure, caught, completed, old, phases, mark_restarting=mark)
            raise raised from (None if raised is failure else failure)
        self._adopt(new, job, decision, {"caught": caught, "t0": t0, "step": step, "old": old, "phases": phases,
                                         "at": completed})
        return job, step

    def _applied(self, old: Membership, completed: int) -> int:
        """The last step every rank applied: a recovery is possible at all, and steps the device
        skipped (their commits failed) are not counted."""
        if self._round is None or self._joins is None:
            raise RecoveryFailed("no recovery store")
        if old.generation >= self._max:
            raise RecoveryFailed(f"{self._max} in-process recoveries already; leaving it to torchrun")
        skipped = self._commit.unapplied() if self._commit is not None else 0
        if skipped:   # the device skipped steps the host saw return (their commits failed)
            log.warning("rankwatch: the last %d optimizer step(s) were skipped on the device: completed "
                        "step %d, not %d", skipped, completed - skipped, completed)
        return completed - skipped

    def _agree(self, old: Membership, job: Job, completed: int, breaking: bool, ready: bool,
               phases: dict[str, float], t0: float) -> tuple[Any, Any]:
        """Leave the failed step's groups and agree with the survivors on the new world."""
        assert self._round is not None and self._joins is not None
        shards = local_state(job)
        if self.snapshots is not None and (breaking or self._round.joiners_waiting(self._joins.settled)):
            self.snapshots.keep_now(job, completed)   # joiners may come in: the world grows from now
        holdings = self._holdings()
        net.destroy_groups()
        phases["left_step"] = time.perf_counter() - t0
        decision = self._round.agree(old, completed, job.replica_size, ready, self._joins.settled, holdings)
        phases["agreed"] = time.perf_counter() - t0
        if not decision.ok:
            raise RecoveryFailed(decision.error)
        return decision, shards

    def _placed(self, old: Membership, decision: Any, job: Job, completed: int, shards: Any) -> tuple[Membership, Any]:
        """This rank's place in the agreed world (a member that must finish the step does)."""
        assert self._round is not None
        if old.members[old.rank] in decision.finish and self._commit is not None:
            shards = self._commit.finish_step(job, completed)
        return rebuild.placed(old, decision, self._round.node), shards

    def _adopt(self, new: Membership, job: Job, decision: Any, done: dict[str, Any]) -> None:
        """Take the new world as this rank's, and keep the attempt's report for its first step."""
        assert self._joins is not None and self._breaks is not None
        old, phases, step = done["old"], done["phases"], done["step"]
        self.membership = new
        self._joins.follow(new.rank, job.replica_size)
        self._joins.settle(decision)
        self._breaks.follow(new.generation)
        self._report = done
        joined = [r for r in decision.members if r not in old.members]
        log.warning("rankwatch: recovered in process: rank %d -> %d of %d, without node(s) %s%s, from step %d "
                    "(%.3f s so far)", old.rank, new.rank, new.world_size, ", ".join(decision.dropped_nodes) or "-",
                    f", with {len(joined)} joining worker(s)" if joined else "", step, phases["restored"])

    def _holdings(self) -> dict | None:
        """What this rank can recover a lost node's shards from: the peer snapshots here (once
        the exchange in flight is done), and whether it can reload a checkpoint."""
        snaps = self.snapshots
        held = snaps.holdings() if snaps is not None and snaps.wait(2.0) else None
        if self._reload is None:
            return held
        return {**(held or {"own": -1, "held": {}}), "reload": True}

    def _leave(self) -> int:
        """Leave the step, and tell every other worker to leave it too (see :mod:`breakout`)."""
        if self._breaks is not None:
            self._breaks.recovering()
        shut = self._leave_own()
        if self._breaks is not None and (m := self.membership) is not None:
            self._breaks.announce(m.generation, m.members[m.rank])
        return shut

    def _leave_own(self) -> int:
        return leave_step(self._backend, self._baseline, self._excluded_endpoints)

    # -- joining ----------------------------------------------------------------------
    def _join(self) -> Job:
        """Ask to join the round's survivors; wait until they admit this worker at a step
        boundary; build the job and take its state from a live replica."""
        assert self._round is not None and self._joins is not None and self._breaks is not None
        warm_up()   # before asking: the survivors pause from the moment they admit this worker
        self._liveness = net.Liveness()
        local_rank = int(self._env.get("LOCAL_RANK", "0"))
        standby = self._env.get(STANDBY_ENV) == "1"   # a hot spare's: admitted at a loss, however late
        me = self._round.ask_to_join(self._liveness.address, local_rank, int(self._env.get("LOCAL_WORLD_SIZE", "1")),
                                     standby, reload=self._reload is not None)
        log.warning("rankwatch: worker %d of node %s asks to join the training in process%s", local_rank,
                    self._round.node, " at the next lost node's place" if standby else "")
        gen, decision = self._round.await_admission(me, _STANDBY_WAIT if standby else self._join_timeout)
        new = Membership(generation=gen, rank=decision.members.index(me), world_size=len(decision.members),
                         members=decision.members, dropped_nodes=decision.dropped_nodes)
        self.membership = new
        self._init_group(new)
        job = self._build(new)   # the state from a live replica, or the survivors' snapshots
        self.completed = rebuild.put_back(job, decision, new.rank, {}, self.snapshots, self._reload, {},
                                          time.perf_counter())
        self._joins.follow(new.rank, job.replica_size)
        self._joins.settle(decision)
        self._breaks.follow(gen)
        self._breaks.start()
        self._round.mark_admitted(gen)
        log.warning("rankwatch: joined in process as rank %d of %d at step %d", new.rank, new.world_size,
                    decision.step)
        return job

    # -- the end ----------------------------------------------------------------------
    def finish(self, step: int) -> None:
        """Call once the loop is done (every rank, after its last step).  Rank 0 tells the
        workers still asking to join that the job finished, so they exit cleanly (each gets
        :class:`JobFinished`) instead of waiting out ``join_timeout`` and failing their node.
        Never raises: the job's end does not depend on it."""
        if self._joins is not None:
            self._joins.finish(step)

    # -- parts ----------------------------------------------------------------------
    def _init_group(self, new: Membership) -> None:
        import torch.distributed as dist

        assert self._round is not None
        dist.init_process_group(self._backend, store=self._round.process_group_store(new.generation),
                                rank=new.rank, world_size=new.world_size, timeout=self._timeout)
        net.forget_old_meshes()

    def set_monitor(self, monitor: Any) -> None:
        """The Monitor that reports each recovery (made after the first generation's mesh)."""
        self._monitor = monitor

    def _finish_report(self, step: int) -> dict[str, float]:
        r, self._report = self._report, None
        assert r is not None and self.membership is not None
        self._regain = (r["at"], r["caught"])
        r["phases"]["first_step"] = time.perf_counter() - r["t0"]
        log.warning("rankwatch: first step after the in-process recovery: step %d, %.3f s after the failure "
                    "(%s)", step, r["phases"]["first_step"],
                    ", ".join(f"{k} {v:.3f}" for k, v in r["phases"].items()))
        report.send(self._monitor, r["caught"], r["step"], r["old"], self.membership, r["phases"], True, failed_at=r["at"])
        return r["phases"]

    @property
    def last_phases(self) -> dict[str, float] | None:
        """The phases of the recovery whose first step is still to come (for tests, logs)."""
        return dict(self._report["phases"]) if self._report else None
