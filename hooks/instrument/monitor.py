"""The per-rank entry point: ``rankwatch.hooks.init()`` returns a Monitor.

A Monitor ties the recorder (hot path), the collective timers and the agent
client together.  It never raises into training: if anything in rankwatch
fails to start, the caller gets a :class:`NullMonitor` with the same methods.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, TypeVar

from rankwatch.address import Address, node_id, resolve
from rankwatch.proto import pb
from rankwatch.hooks.instrument.batches import SNAPSHOT_FIELDS, snapshot_stats
from rankwatch.hooks.instrument.recorder import (
    ACTIVITY_CHECKPOINT,
    ACTIVITY_EVAL,
    ACTIVITY_RECOVERY,
    ACTIVITY_TRAIN,
    Recorder,
    StepScope,
)
from rankwatch.hooks.instrument.hello import credentials, mesh_of
from rankwatch.hooks.instrument.hello import hello as make_hello
from rankwatch.hooks.instrument.stage_infer import with_stage

__all__ = ["DISABLE_ENV", "ZERO_CODE", "Monitor", "NullMonitor", "init"]

log = logging.getLogger(__name__)

T = TypeVar("T")
DISABLE_ENV = "RANKWATCH_DISABLE"
ZERO_CODE: list[Any] = []
"""The zero-code instrumentation of this process, if it runs (it puts itself here): an
explicit :func:`init` stands it down first, so that the script's own markers are the only ones."""
_ACTIVITIES = {"train": ACTIVITY_TRAIN, "eval": ACTIVITY_EVAL, "checkpoint": ACTIVITY_CHECKPOINT,
               "recovery": ACTIVITY_RECOVERY}


class Monitor:
    """Instrumentation of one rank.  Build it with :func:`init`.

    Use::

        with mon.step(n, tokens=t, flops=f):
            batch = next(it);      mon.mark("data")
            loss = model(batch);   mon.mark("forward")
            loss.backward();       mon.mark("backward")
            opt.step();            mon.mark("optimizer")
    """

    def __init__(self, recorder: Recorder, instrumentation: Any, client: Any) -> None:
        self.recorder = recorder
        self._instr = instrumentation
        self._client = client
        self._served: dict[int, str] = {}  # step -> the request id its save serves
        self._agree_device: Any = None     # where checkpoint_due's all-reduce runs
        self.mark = recorder.mark  # the hot path: a bound method, no indirection
        self._stage: tuple[int, int] | None = None   # found from the pipelining library's stages
        chunks = getattr(instrumentation, "chunks", None)
        if chunks is not None:
            chunks.on_stage = self._stage_found

    def step(self, step: int, tokens: float = 0.0, flops: float = 0.0) -> StepScope:
        """Bracket one training step; phases inside are closed with :meth:`mark`."""
        return self.recorder.step_scope(step, tokens, flops)

    def steps(self, batches: Iterable[T], start: int = 1, tokens: float = 0.0,
              flops: float = 0.0) -> Iterator[tuple[int, T]]:
        """``for n, batch in mon.steps(loader):`` -- each step's scope opens before its batch is
        fetched, so a slow loader counts as the step's ``data`` phase, never as time between steps.

        The body marks the phases after data (forward, backward, optimizer); a step ends when
        the next batch is asked for, when the loop breaks, or at the loader's end.
        """
        rec, n = self.recorder, start
        it = iter(batches)
        while True:
            t0 = time.perf_counter_ns()
            try:
                batch = next(it)
            except StopIteration:  # the loader is done: no step n
                return
            rec.begin_step(n, t0, since_last=True)  # it began when its batch was asked for
            rec.mark("data")
            try:
                yield n, batch
            finally:
                rec.end_step(tokens, flops)
            n += 1

    @contextlib.contextmanager
    def activity(self, name: str) -> Iterator[None]:
        """Mark a stretch as ``eval``, ``checkpoint`` or ``recovery`` (the in-process tier's), so
        that it is given its longer allowance and not taken for a hang."""
        prev = self.recorder.activity
        self.recorder.activity = _ACTIVITIES[name]
        try:
            yield
        finally:
            self.recorder.activity = prev

    def mesh_built(self, mesh: Any) -> None:
        """A DeviceMesh built after :func:`init` (zero-code instrumentation sees it built): its
        dimension names and this rank's coordinates go to the agent with the next batch."""
        coords, shape = mesh_of(mesh)
        if coords and self._client is not None:
            self._client.update_mesh(*with_stage(coords, shape, self._stage))

    def expert_load(self, counts: Iterable[int]) -> None:
        """This step's tokens routed to each of this rank's local experts (a mixture of experts:
        call once a step, inside it).  The agent names ``expert_load`` as a straggler's cause when
        the slow rank's experts got more tokens than the others'.  Hot path: one append."""
        self.recorder.expert_load(counts)

    def peer_snapshot(self, stats: Any) -> None:
        """The in-process tier's peer snapshots took one, or planned none (``stats``: the
        :data:`SNAPSHOT_FIELDS` of its ``Stats``); sent with the next batch."""
        self.recorder.snapshot = tuple(getattr(stats, f, 0) for f in SNAPSHOT_FIELDS)

    def pipeline_stage(self, stage: int, stages: int) -> None:
        """This rank's pipeline stage, for a script that splits its model without a DeviceMesh
        ``pp`` dimension: stragglers are then compared within a stage, never across stages."""
        if self._client is not None and 0 <= stage < stages:
            self._client.update_mesh({"pp": int(stage)}, {"pp": int(stages)})

    def _stage_found(self, stage: int, stages: int) -> None:
        """This rank's stage, from the pipelining library (sender thread): the ``pp`` coordinate."""
        self._stage = (stage, stages)
        if self._client is not None:
            self._client.update_mesh(*with_stage(*self._client.mesh, self._stage))

    @property
    def dropped(self) -> int:
        return self._client.dropped_total if self._client else 0

    def requested_checkpoint(self) -> int:
        """The step of the earliest checkpoint the agent asked for, as this rank knows it, or -1.

        Ranks may learn of a request at different steps: use :meth:`checkpoint_due`,
        which agrees across ranks, to decide whether to save.
        """
        req = self._client.requested_checkpoint() if self._client else None
        return req[0] if req else -1

    def checkpoint_due(self, step: int, group: Any = None) -> bool:
        """Whether to save a checkpoint after ``step``: the same answer on every rank.

        A collective (MAX over ``group``, default the world), so every rank of the
        group must call it after the same step.  True once the agent asked for a
        checkpoint at or before ``step``; a request some ranks heard of late is
        served at the first step where all agree.  Then call
        :meth:`checkpoint_started`, save, and :meth:`checkpoint_saved`.
        """
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            return 0 <= self.requested_checkpoint() <= step
        if self._agree_device is None:
            backend = dist.get_backend(group)
            self._agree_device = (torch.device("cuda", torch.cuda.current_device())
                                  if backend == "nccl" else torch.device("cpu"))
        want = torch.tensor([self.requested_checkpoint()], dtype=torch.int64, device=self._agree_device)
        dist.all_reduce(want, op=dist.ReduceOp.MAX, group=group)
        return 0 <= int(want.item()) <= step

    def checkpoint_started(self, step: int) -> None:
        """A save of ``step`` begins: the agent's requests up to it are served by it."""
        if self._client is not None:
            self._served[step] = self._client.serve_requests(step)

    def checkpoint_saved(self, step: int, *, started_at: float, duration: float, path: str = "",
                         ok: bool = True, error: str = "", completed_after: float = 0.0,
                         asynchronous: bool = False) -> None:
        """Report a finished checkpoint save (periodic or requested) to the agent.

        ``duration`` is the training thread's time on it; ``completed_after`` the
        time until it was complete on disk (later, for an asynchronous save).
        """
        if self._client is None:
            return
        rid = self._served.pop(step, None)
        if rid is None:  # reported without checkpoint_started
            rid = self._client.serve_requests(step)
        self._client.checkpoint_saved(pb.CheckpointRecord(
            step=step, started_at=started_at, duration=duration, path=path, request_id=rid,
            ok=ok, error=error[:2000], completed_after=max(completed_after, duration),
            asynchronous=asynchronous))

    def recovered(self, *, started_at: float, step: int, old_world_size: int, new_world_size: int,
                  dropped_nodes: Iterable[str], phases: Mapping[str, float], ok: bool, error: str = "",
                  rank_after: int, failed_at: int | None = None) -> None:
        """Report an in-process recovery this rank took part in, or a failed attempt at one.

        Every surviving rank reports it; the agent keeps one incident per recovery and node.
        ``started_at`` is when this rank caught the failure (Unix seconds), ``step`` the last
        step every survivor completed, ``phases`` the seconds since ``started_at`` at the end
        of each phase reached (``left_step``, ``agreed``, ``reinitialised``, ``restored``,
        ``first_step``), ``rank_after`` this rank's rank in the new world, ``failed_at`` the
        step the failure cut short (the steps after ``step`` up to it are trained again), and the
        latest peer snapshot's copy and send go with it where it takes them.  The record waits
        in a bounded buffer for the sender thread.  Never raises: the recovery tier calls it
        on its way back to training, and a report must not stop that.
        """
        if self._client is None:
            return
        try:
            record = pb.RecoveryRecord(
                started_at=started_at, step=step, old_world_size=old_world_size,
                new_world_size=new_world_size, dropped_nodes=[str(n) for n in dropped_nodes],
                ok=ok, error=str(error)[:2000], phases={str(k): float(v) for k, v in phases.items()},
                rank_after=rank_after)
            if failed_at is not None:
                record.failed_at = int(failed_at)
            if self.recorder.snapshot is not None:
                record.snapshot.CopyFrom(snapshot_stats(self.recorder.snapshot))
            self._client.recovered(record)
        except Exception:  # noqa: BLE001 - reporting never fails the recovery
            log.exception("rankwatch: recovery at step %s not reported", step)

    def close(self) -> None:
        """Flush what is buffered (bounded wait) and remove the collective timers."""
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._instr is not None:
            self._instr.uninstall()


class NullMonitor:
    """The same surface as :class:`Monitor`, doing nothing."""

    recorder = None
    dropped = 0

    def step(self, step: int, tokens: float = 0.0, flops: float = 0.0) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def steps(self, batches: Iterable[T], start: int = 1, tokens: float = 0.0,
              flops: float = 0.0) -> Iterator[tuple[int, T]]:
        return enumerate(batches, start)

    def mark(self, phase: str) -> None:
        pass

    def mesh_built(self, mesh: Any) -> None:
        pass

    def expert_load(self, counts: Iterable[int]) -> None:
        pass

    def peer_snapshot(self, stats: Any) -> None:
        pass

    def pipeline_stage(self, stage: int, stages: int) -> None:
        pass

    def activity(self, name: str) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def requested_checkpoint(self) -> int:
        return -1

    def checkpoint_due(self, step: int, group: Any = None) -> bool:
        return False

    def checkpoint_started(self, step: int) -> None:
        pass

    def checkpoint_saved(self, step: int, **_: Any) -> None:
        pass

    def recovered(self, **_: Any) -> None:
        pass

    def close(self) -> None:
        pass


def init(*, mesh: Any = None, address: str | None = None, node: str | None = None,
         peak_flops: float | None = None, job_id: str | None = None,
         collectives: bool = True) -> Monitor | NullMonitor:
    """Start rankwatch in this rank, after ``init_process_group``.

    Args:
        mesh: the job's ``DeviceMesh``; its dimension names and this rank's
            coordinates are reported (dp, tp, pp, cp, ep, or any others).
        address: the node agent; default ``$RANKWATCH_AGENT``, then the default socket.
        node: the node id; default ``$RANKWATCH_NODE_ID``, then the host name.
        peak_flops: this rank's device peak FLOP/s for MFU; default from the
            device table (GPUs), or none (CPU).
        job_id: default ``$TORCHELASTIC_RUN_ID``.
        collectives: time collectives (off only for overhead comparisons).

    Returns:
        A :class:`Monitor`, or a :class:`NullMonitor` when ``RANKWATCH_DISABLE=1``
        or anything fails; training goes on either way.
    """
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return NullMonitor()
    for auto in ZERO_CODE:
        auto.stand_down()
    try:
        monitor = _init(mesh, resolve(address), node_id(node), peak_flops, job_id, collectives)
    except Exception:  # noqa: BLE001 - rankwatch never stops training
        log.exception("rankwatch: instrumentation failed to start; training without it")
        return NullMonitor()
    for auto in ZERO_CODE:
        auto.adopt(monitor)
    return monitor


def _init(mesh: Any, address: Address, node: str, peak_flops: float | None,
          job_id: str | None, collectives: bool, *, recorder: Recorder | None = None,
          instrumentation: str = "explicit") -> Monitor:
    from rankwatch.hooks.instrument.client import AgentClient
    from rankwatch.hooks.instrument.collectives import CollectiveInstrumentation

    recorder = recorder or Recorder()
    instr = CollectiveInstrumentation(recorder)
    if collectives:
        instr.install()
    hello = make_hello(mesh, node, peak_flops, job_id)
    hello.collective_source = instr.source
    hello.instrumentation = instrumentation
    client = AgentClient(recorder, hello, address, last_seq=instr.last_seq,
                         group_seqs=instr.group_seqs, group_names=instr.group_names, creds=credentials())
    __import__("rankwatch.hooks.instrument.exit_capture", fromlist=["install"]).install(recorder, client, hello)
    client.start()
    monitor = Monitor(recorder, instr, client)
    atexit.register(monitor.close)
    return monitor
