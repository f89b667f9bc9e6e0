"""A rank's records as the wire carries them: columnar ``Batch`` messages.

The rank client's flusher thread (:mod:`rankwatch.hooks.instrument.client`) drains the recorder's
deques here, never the training thread.  A batch holds up to ``max_batch`` collective and
step records as packed columns, the rank's progress (step, phase, the collective in flight,
and its stacks and Flight Recorder entries when it looks stuck), and the count of records
dropped so far.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from rankwatch.hooks.instrument.hang_evidence import all_stacks, flight_recorder_pending
from rankwatch.hooks.instrument.op_record import peer_rank
from rankwatch.hooks.instrument.recorder import ACTIVITY_IDLE, ACTIVITY_TRAIN, OPS, Recorder
from rankwatch.proto import pb

__all__ = ["SNAPSHOT_FIELDS", "BatchBuilder", "snapshot_stats"]

SNAPSHOT_FIELDS = ("step", "memory_bytes", "sent_bytes", "send_seconds", "copy_seconds", "exchanges", "failures",
                   "every", "reason", "work_seconds")
"""The peer snapshots' stats as the recorder keeps them (a tuple in this order): ``SnapshotStats``'s fields."""

_STACKS_EVERY = 2.0       # seconds between a stuck rank's stack samples
_STUCK_MIN = 2.0          # a step running this long, and 4x its usual time, looks stuck
_STUCK_ELSEWHERE = 60.0   # ... and this long in a checkpoint or an evaluation


MAX_GROUPS = 256          # process-group names a batch carries (the agent's bound)
MAX_GROUP_NAME = 128      # characters of each


class BatchBuilder:
    """Args:
        recorder: the buffers the training thread writes.
        max_batch: records of each kind per batch.
        last_seq: returns the rank's latest collective sequence number.
        group_seqs: returns each process group's latest sequence number.
        group_names: returns each process group's name, indexed by the code records carry.
    """

    def __init__(self, recorder: Recorder, max_batch: int, last_seq: Callable[[], int],
                 group_seqs: Callable[[], dict[str, int]],
                 group_names: Callable[[], list[str]] = list) -> None:
        self._rec = recorder
        self._group_names = group_names
        self._max_batch = max_batch
        self._last_seq = last_seq
        self._group_seqs = group_seqs
        self._recent_steps: deque[float] = deque(maxlen=32)
        self._stacks_at = 0.0
        self._seq = 0
        self._drained = 0          # collective records taken from the deque
        self._max_index = -1       # highest record index seen
        self.overflow = 0
        """Collective records the recorder's bounded deque discarded before a drain."""
        self._sent_snapshot: tuple | None = None   # the peer snapshots' stats last sent

    def build(self, checkpoints: deque[pb.CheckpointRecord], recoveries: deque[pb.RecoveryRecord],
              dropped_total: Callable[[], int]) -> tuple[pb.Batch, int]:
        """The next batch (numbered in order) and the records in it; takes every record of
        ``checkpoints`` and ``recoveries``.  ``dropped_total`` is asked after the drain (which
        finds the deque's overflow)."""
        rec = self._rec
        self._seq += 1
        batch = pb.Batch(seq=self._seq)
        n = 0
        coll = _drain(rec.collectives, self._max_batch)
        if coll:
            n += len(coll)
            batch.collectives.CopyFrom(self._collective_columns(coll))
        steps = _drain(rec.steps, self._max_batch)
        if steps:
            n += len(steps)
            batch.steps.CopyFrom(self._step_columns(steps))
        while checkpoints:
            batch.checkpoints.append(checkpoints.popleft())
        while recoveries:
            batch.recoveries.append(recoveries.popleft())
        for step, tokens in _drain(rec.expert_loads, self._max_batch):
            batch.expert_loads.append(pb.ExpertLoad(step=step, tokens=tokens))
        snap = rec.snapshot
        if snap is not None and snap is not self._sent_snapshot:   # the latest, once
            self._sent_snapshot = snap
            batch.snapshot.CopyFrom(snapshot_stats(snap))
            n += 1
        # Counted, so that a batch holding only them is sent (not discarded as empty).
        n += len(batch.checkpoints) + len(batch.recoveries) + len(batch.expert_loads)
        batch.progress.CopyFrom(self._progress())
        batch.dropped_total = dropped_total()
        return batch, n

    def _progress(self) -> pb.Progress:
        rec = self._rec
        p = pb.Progress(step=rec.step, phase=rec.activity, last_collective_seq=self._last_seq(),
                        sampled_at=time.time(),
                        step_started_at=rec.to_unix(rec.step_started_ns) if rec.step >= 0 else 0.0)
        p.group_seqs.update(self._group_seqs())
        inflight = rec.inflight
        if inflight is not None:
            op, pg, t0, peer = inflight
            p.inflight.CopyFrom(pb.InFlight(
                op=OPS[op] if 0 <= op < len(OPS) else "other", since=rec.to_unix(t0),
                group=str(getattr(pg, "group_name", "")) if pg is not None else "",
                seq=_seq_of(pg), peer=peer_rank(pg, peer)))
            chunk = rec.microbatch
            if chunk is not None:
                p.inflight.microbatch, p.inflight.microbatch_pass = chunk[1], chunk[0]
        if self._stuck(rec):
            p.stacks = all_stacks()
            p.flight_recorder = flight_recorder_pending()
        return p

    def _stuck(self, rec: Recorder) -> bool:
        """No step has started for far longer than usual: time to take stacks and the Flight
        Recorder (every 2 s).  Between steps too (a collective after the step scope, e.g. a
        loss all-reduce, can hang as well); in a checkpoint or an evaluation only after a minute."""
        if rec.step < 0:
            return False
        usual = sorted(self._recent_steps)[len(self._recent_steps) // 2] if self._recent_steps else 1.0
        since_start = (time.perf_counter_ns() - rec.step_started_ns) * 1e-9
        bound = max(_STUCK_MIN, 4 * usual) if rec.activity in (ACTIVITY_TRAIN, ACTIVITY_IDLE) else _STUCK_ELSEWHERE
        now = time.monotonic()
        if since_start > bound and now - self._stacks_at >= _STACKS_EVERY:
            self._stacks_at = now
            return True
        return False

    def _collective_columns(self, records: list[tuple]) -> pb.CollectiveColumns:
        arr = np.array(records, dtype=np.int64)
        self._drained += len(records)
        self._max_index = max(self._max_index, int(arr[:, 0].max()))
        self.overflow = max(self.overflow, self._max_index + 1 - self._drained - len(self._rec.collectives))
        rec = self._rec
        start = rec.wall0 + (arr[:, 4] - rec.mono0_ns) * 1e-9
        duration = (arr[:, 5] - arr[:, 4]) * 1e-9
        try:
            names = [name[:MAX_GROUP_NAME] for name in self._group_names()[:MAX_GROUPS]]
        except Exception:  # noqa: BLE001 - the names are an extra: the records go without them
            names = []
        return pb.CollectiveColumns(
            op=arr[:, 1].astype("<u1").tobytes(), pg=arr[:, 2].astype("<u2").tobytes(),
            seq=arr[:, 3].astype("<i8").tobytes(), start=start.astype("<f8").tobytes(),
            duration=duration.astype("<f8").tobytes(), nbytes=arr[:, 6].astype("<i8").tobytes(),
            pg_names=names)

    def _step_columns(self, steps: list[tuple]) -> pb.StepColumns:
        rec = self._rec
        cols = pb.StepColumns()
        for step, t0, t1, data, fwd, bwd, opt, tokens, flops, blocked in steps:
            cols.step.append(step)
            cols.start.append(rec.to_unix(t0))
            cols.duration.append((t1 - t0) * 1e-9)
            self._recent_steps.append((t1 - t0) * 1e-9)
            cols.data.append(data * 1e-9)
            cols.forward.append(fwd * 1e-9)
            cols.backward.append(bwd * 1e-9)
            cols.optimizer.append(opt * 1e-9)
            cols.tokens.append(tokens)
            cols.flops.append(flops)
            cols.wait.append(blocked * 1e-9)
        return cols


def _seq_of(pg: Any) -> int:
    try:
        return int(pg._get_sequence_number_for_group()) if pg is not None else -1
    except Exception:  # noqa: BLE001
        return -1


def _drain(dq: Any, limit: int) -> list[tuple]:
    out = []
    pop = dq.popleft
    try:
        for _ in range(limit):
            out.append(pop())
    except IndexError:
        pass
    return out


def snapshot_stats(snap: tuple) -> pb.SnapshotStats:
    """The peer snapshots' stats as the recorder keeps them (:attr:`Recorder.snapshot`), for the wire."""
    return pb.SnapshotStats(**dict(zip(SNAPSHOT_FIELDS, snap)))

