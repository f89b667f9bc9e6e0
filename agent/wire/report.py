"""Ranges of what a rank sends on its ``Report`` stream: its hello, and each batch's step
and collective columns, progress, checkpoint and recovery records (bounds: :mod:`validate`).

A batch's shapes are checked first, before the node state's lock (:func:`decode_collectives`,
:func:`check_step_shapes`, :func:`check_progress_shape`), then its values (:func:`check_batch`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from rankwatch.agent.wire import inflight as in_flight
from rankwatch.agent.wire.ranges import (
    MAX_CLOCK_AHEAD, MAX_DROPPED_NODES, MAX_DURATION, MAX_EXPERTS, MAX_GROUP_NAMES, MAX_LABEL, MAX_OP_NAMES, MAX_RECORDS_PER_BATCH, MAX_RECOVERIES_PER_BATCH,
    MAX_CHECKPOINTS_PER_BATCH, MAX_STACKS, MAX_STEP, MAX_WORLD_SIZE, Rejected, check_count,
    check_duration, check_flight_recorder, check_label, check_recovery_phases,
    check_timestamp, parse_flight_recorder,
)
from rankwatch.proto import pb

__all__ = [
    "SNAPSHOT_REASONS", "check_batch", "check_checkpoints", "check_collective_columns", "check_expert_loads", "check_group_names", "check_hello", "check_snapshot", "check_mesh", "check_progress",
    "check_progress_shape", "check_recovery", "check_step_columns", "check_step_shapes", "decode_collectives",
]

SNAPSHOT_REASONS = ("fits", "override", "disabled", "memory", "single_node", "replicas", "measuring")
"""``SnapshotStats.reason``'s meanings, in order (the hooks' ``budget.REASONS``)."""

_COLUMNS = tuple((name, np.dtype(dtype)) for name, dtype in (
    ("op", "<u1"), ("pg", "<u2"), ("seq", "<i8"), ("start", "<f8"), ("duration", "<f8"), ("nbytes", "<i8")))

# Whole-column reductions called as ufuncs (no Python wrapper between): NaN propagates
# through minimum and maximum, so a NaN fails any comparison with their results.
_MIN, _MAX, _OR = np.minimum.reduce, np.maximum.reduce, np.bitwise_or.reduce


def decode_collectives(c: pb.CollectiveColumns, n_ops: int) -> dict[str, np.ndarray]:
    """A batch's collective columns as arrays, refused unless every column holds the batch's
    records and op codes name the rank's ops (their values: :func:`check_collective_columns`)."""
    n = len(c.op)
    if n > MAX_RECORDS_PER_BATCH:
        raise Rejected("oversized", f"{n} collective records in one batch")
    cols = {}
    for name, dtype in _COLUMNS:
        raw = getattr(c, name)
        if len(raw) != n * dtype.itemsize:
            raise Rejected("malformed", f"collective column {name} has {len(raw)} bytes for {n} records")
        cols[name] = np.frombuffer(raw, dtype=dtype)
    if n and int(_MAX(cols["op"])) >= n_ops:
        raise Rejected("malformed", "collective op code outside the rank's op names")
    check_group_names(c.pg_names)
    return cols


def check_group_names(names: Sequence[str]) -> None:
    """The process-group names of a batch's collective columns: at most ``MAX_GROUP_NAMES``,
    each at most ``MAX_LABEL`` characters.  A pg code beyond them has no name (its records
    are not lined up with other ranks'), which is no error."""
    if len(names) > MAX_GROUP_NAMES:
        raise Rejected("oversized", f"{len(names)} process-group names in one batch (at most {MAX_GROUP_NAMES})")
    if any(len(name) > MAX_LABEL for name in names):
        raise Rejected("oversized", f"a process-group name over {MAX_LABEL} characters")


def check_step_shapes(s: pb.StepColumns) -> pb.StepColumns:
    """Step columns of one length, finite and not negative (their ranges: :func:`check_step_columns`)."""
    n = len(s.step)
    if n > MAX_RECORDS_PER_BATCH:
        raise Rejected("oversized", f"{n} step records in one batch")
    fields = (s.start, s.duration, s.data, s.forward, s.backward, s.optimizer, s.tokens, s.flops)
    if any(len(f) != n for f in fields) or len(s.wait) not in (0, n):
        raise Rejected("malformed", "step columns of different lengths")
    if s.wait and (not all(math.isfinite(w) and w >= 0 for w in s.wait)):
        raise Rejected("invalid_value", "step wait is NaN, infinite or negative")
    if n == 0:
        raise Rejected("malformed", "empty step columns")
    arr = np.array(fields, dtype=np.float64)
    if not np.all(np.isfinite(arr)) or (arr[1:] < 0).any() or min(s.step) < 0:
        raise Rejected("invalid_value", "step value is NaN, infinite or negative")
    return s


def check_progress_shape(p: pb.Progress) -> None:
    """A progress record's times finite, its sizes capped, its Flight Recorder extract parsed."""
    if not (math.isfinite(p.step_started_at) and math.isfinite(p.sampled_at)
            and math.isfinite(p.inflight.since)):
        raise Rejected("invalid_value", "progress time is NaN or infinite")
    if len(p.group_seqs) > 256 or len(p.stacks) > MAX_STACKS or len(p.flight_recorder) > MAX_STACKS:
        raise Rejected("oversized", "too many groups, too long stacks or Flight Recorder in progress")
    if p.flight_recorder:
        try:
            parse_flight_recorder(p.flight_recorder)
        except ValueError as exc:
            raise Rejected("malformed", f"flight_recorder: {exc}") from None
    for name in list(p.group_seqs) + [p.inflight.op, p.inflight.group]:
        check_label(name, "a group or op name", "invalid_hello")
    if p.step_started_at < 0 or p.step < -1:
        raise Rejected("invalid_value", "negative progress")



def check_hello(msg: pb.Hello) -> None:
    """A rank's hello: its world, rank, pid, names and mesh."""
    if not 0 < msg.world_size <= MAX_WORLD_SIZE:
        raise Rejected("invalid_hello", f"world_size {msg.world_size} out of range")
    if not 0 <= msg.rank < msg.world_size:
        raise Rejected("unknown_rank", f"rank {msg.rank} not in [0, {msg.world_size})")
    if msg.local_rank < 0 or msg.pid <= 0:
        raise Rejected("invalid_hello", f"local_rank {msg.local_rank} / pid {msg.pid} invalid")
    if len(msg.op_names) > MAX_OP_NAMES:
        raise Rejected("invalid_hello", "too many op names")
    check_mesh(msg.mesh_coords, msg.mesh_shape, "invalid_hello")
    if not math.isfinite(msg.peak_flops) or msg.peak_flops < 0:
        raise Rejected("invalid_hello", f"peak_flops {msg.peak_flops} invalid")
    for value in (msg.node_id, msg.backend, msg.device, msg.device_uuid, msg.collective_source,
                  msg.job_id, msg.instrumentation, *msg.op_names):
        check_label(value, "a name in the hello", "invalid_hello")
    if msg.pid >= 1 << 32:
        raise Rejected("invalid_hello", f"pid {msg.pid} out of range")


def check_mesh(coords: Mapping[str, int], shape: Mapping[str, int], code: str) -> None:
    """A DeviceMesh as a rank reports it (in its Hello or a later MeshUpdate): at most 16
    dimensions, names that are labels, coordinates and sizes in [0, 2^20)."""
    if len(coords) > 16 or len(shape) > 16:
        raise Rejected(code, "too many mesh dimensions")
    for name in (*coords, *shape):
        check_label(name, "a mesh dimension name", code)
    for value in (*coords.values(), *shape.values()):
        if not 0 <= value < 1 << 20:
            raise Rejected(code, f"mesh coordinate {value} out of range")


def check_batch(batch: pb.Batch, collectives: dict[str, np.ndarray] | None = None,
                now: float | None = None) -> None:
    """Every range of a batch whose shapes :meth:`NodeState.ingest` checked: its counters,
    step and collective columns (``collectives`` decoded), progress and checkpoint records."""
    now = time.time() if now is None else now
    check_count(batch.seq, "batch seq")
    check_count(batch.dropped_total, "dropped_total")
    if collectives is not None:
        check_collective_columns(collectives, now)
    if batch.HasField("steps"):
        check_step_columns(batch.steps, now)
    if batch.HasField("progress"):
        check_progress(batch.progress, now)
        if batch.progress.flight_recorder:
            try:
                doc = parse_flight_recorder(batch.progress.flight_recorder)
                if doc is not None:
                    check_flight_recorder(doc, now)
            except ValueError as exc:
                raise Rejected("malformed", f"flight_recorder: {exc}") from None
    check_checkpoints(batch.checkpoints, now)
    if batch.HasField("mesh"):
        check_mesh(batch.mesh.mesh_coords, batch.mesh.mesh_shape, "invalid_value")
    if len(batch.recoveries) > MAX_RECOVERIES_PER_BATCH:
        raise Rejected("oversized", f"{len(batch.recoveries)} recovery records in one batch")
    if batch.expert_loads:
        check_expert_loads(batch.expert_loads)
    if batch.HasField("snapshot"):
        check_snapshot(batch.snapshot)


def check_snapshot(s: pb.SnapshotStats) -> None:
    """A rank's peer-snapshot stats: a step, byte counts and counts in range, two durations."""
    check_count(s.step, "snapshot step", lo=-1)
    for value, what in ((s.memory_bytes, "snapshot memory_bytes"), (s.sent_bytes, "snapshot sent_bytes"),
                        (s.exchanges, "snapshot exchanges"), (s.failures, "snapshot failures")):
        check_count(value, what)
    check_duration(s.send_seconds, "snapshot send_seconds")
    check_duration(s.copy_seconds, "snapshot copy_seconds")
    check_duration(s.work_seconds, "snapshot work_seconds")
    check_count(s.every, "snapshot every")
    if s.reason >= len(SNAPSHOT_REASONS):
        raise Rejected("invalid_value", f"snapshot reason {s.reason} (at most {len(SNAPSHOT_REASONS) - 1})")


def check_expert_loads(loads: Sequence[pb.ExpertLoad]) -> None:
    """A batch's expert loads: at most a record a step's worth, 256 experts each, counts in range."""
    if len(loads) > MAX_RECORDS_PER_BATCH:
        raise Rejected("oversized", f"{len(loads)} expert loads in one batch")
    for load in loads:
        check_count(load.step, "expert load step", lo=-1)
        if len(load.tokens) > MAX_EXPERTS:
            raise Rejected("oversized", f"{len(load.tokens)} experts in one load (at most {MAX_EXPERTS})")
        if load.tokens and max(load.tokens) >= MAX_STEP:
            raise Rejected("invalid_value", "an expert's token count outside [0, 2^53)")


def check_step_columns(s: pb.StepColumns, now: float | None = None) -> None:
    """Ranges of step columns whose lengths and signs are checked already."""
    now = time.time() if now is None else now
    steps = np.asarray(s.step, np.int64)
    if steps.size and int(steps.max()) >= MAX_STEP:
        raise Rejected("invalid_value", "step number outside [0, 2^53)")
    durations = np.array((s.duration, s.data, s.forward, s.backward, s.optimizer), np.float64)
    if durations.size and float(durations.max()) > MAX_DURATION:
        raise Rejected("invalid_value", f"step time over {MAX_DURATION:.0f} s")
    if s.wait and max(s.wait) > MAX_DURATION:
        raise Rejected("invalid_value", f"step wait over {MAX_DURATION:.0f} s")
    if s.start and (max(s.start) > now + MAX_CLOCK_AHEAD):
        raise Rejected("invalid_value", "step start is not a plausible Unix time")
    for col, what in ((s.tokens, "tokens"), (s.flops, "flops")):
        if col and max(col) >= 1e30:
            raise Rejected("invalid_value", f"{what} per step implausibly large")


def check_collective_columns(cols: dict[str, np.ndarray], now: float | None = None) -> None:
    """Every value of decoded collective columns: durations finite and in [0, a day], starts
    finite, not negative and not over a day ahead of ``now``, sizes in [0, 2^53), sequence
    numbers in [-1, 2^53).

    Six whole-column passes when all is well: the minimum and maximum of durations and of
    starts (a NaN or an infinity fails their bounds), and the bitwise OR of sizes and of
    sequence numbers (non-negative integers all below 2^53 exactly when their OR is).  A
    column that fails them, or a sequence number of -1, is checked again value by value in
    the full checks, which name what is wrong.
    """
    now = time.time() if now is None else now
    d, start, seq, nbytes = cols["duration"], cols["start"], cols["seq"], cols["nbytes"]
    if not d.size:
        return
    if (0.0 <= _MIN(d) and _MAX(d) <= MAX_DURATION and 0.0 <= _MIN(start) and _MAX(start) <= now + MAX_CLOCK_AHEAD
            and 0 <= int(_OR(nbytes)) < MAX_STEP and 0 <= int(_OR(seq)) < MAX_STEP):
        return
    if not np.all(np.isfinite(d)) or (d < 0).any() or not np.all(np.isfinite(start)):
        raise Rejected("invalid_value", "collective duration or start is NaN, infinite or negative")
    if (nbytes < 0).any():
        raise Rejected("invalid_value", "negative collective size")
    if int(seq.max()) >= MAX_STEP or int(seq.min()) < -1:
        raise Rejected("invalid_value", "collective sequence number outside [-1, 2^53)")
    if int(nbytes.max()) >= MAX_STEP:
        raise Rejected("invalid_value", "collective size over 2^53 bytes")
    if float(d.max()) > MAX_DURATION:
        raise Rejected("invalid_value", f"collective duration over {MAX_DURATION:.0f} s")
    if float(start.min()) < 0 or float(start.max()) > now + MAX_CLOCK_AHEAD:
        raise Rejected("invalid_value", "collective start is not a plausible Unix time")


def check_progress(p: pb.Progress, now: float | None = None) -> None:
    """Ranges of a rank's progress sample (finiteness and sizes are checked already)."""
    check_count(p.step, "progress step", lo=-1)
    check_count(p.last_collective_seq, "last_collective_seq", lo=-1)
    for t, what in ((p.step_started_at, "step_started_at"), (p.sampled_at, "sampled_at")):
        check_timestamp(t, what, now)
    for value in p.group_seqs.values():
        check_count(value, "group sequence number", lo=-1)
    if p.HasField("inflight"):
        in_flight.check(p.inflight, now)


def check_checkpoints(records: Iterable[pb.CheckpointRecord], now: float | None = None) -> None:
    """A batch's checkpoint records: each step, time and duration in range.

    Their strings are not refused but cut and cleaned where they are kept (:func:`clean_text`).
    """
    if not records:   # a batch's repeated field: most batches have none
        return
    records = list(records)
    if len(records) > MAX_CHECKPOINTS_PER_BATCH:
        raise Rejected("oversized", f"{len(records)} checkpoint records in one batch")
    for rec in records:
        check_count(rec.step, "checkpoint step")
        check_timestamp(rec.started_at, "checkpoint started_at", now)
        check_duration(rec.duration, "checkpoint duration")
        check_duration(rec.completed_after, "checkpoint completed_after")
        if len(rec.request_id) > MAX_LABEL:
            raise Rejected("invalid_value", "checkpoint request_id too long")


def check_recovery(rec: pb.RecoveryRecord, now: float | None = None) -> None:
    """One in-process recovery record: its time, step, worlds, dropped nodes and phases.

    Checked one record at a time (:meth:`NodeState.take_recoveries`): a bad record is refused
    alone, the batch that carried it is kept.  Its error text is not refused but cut and
    cleaned where it is kept (:func:`clean_text`), as a checkpoint's is.
    """
    check_timestamp(rec.started_at, "recovery started_at", now)
    if rec.started_at <= 0:
        raise Rejected("invalid_value", "recovery started_at is unset")
    check_count(rec.step, "recovery step", lo=-1)
    if not 0 < rec.old_world_size <= MAX_WORLD_SIZE:
        raise Rejected("invalid_value", f"recovery old_world_size {rec.old_world_size} out of range")
    lowest = 1 if rec.ok else 0   # a failed attempt may end before the new world is known
    if not lowest <= rec.new_world_size <= MAX_WORLD_SIZE:
        raise Rejected("invalid_value", f"recovery new_world_size {rec.new_world_size} out of range")
    if rec.ok and not 0 <= rec.rank_after < rec.new_world_size:
        raise Rejected("invalid_value", f"recovery rank_after {rec.rank_after} not in [0, {rec.new_world_size})")
    if not rec.ok and not -1 <= rec.rank_after < max(rec.new_world_size, 1):
        raise Rejected("invalid_value", f"failed recovery rank_after {rec.rank_after} out of range")
    if len(rec.dropped_nodes) > MAX_DROPPED_NODES:
        raise Rejected("oversized", f"{len(rec.dropped_nodes)} dropped nodes in one recovery")
    for node in rec.dropped_nodes:
        check_label(node, "a recovery's dropped node")
    check_recovery_phases(rec.phases)
    if rec.HasField("failed_at"):
        check_count(rec.failed_at, "recovery failed_at", lo=-1)
    if rec.HasField("snapshot"):
        check_snapshot(rec.snapshot)
