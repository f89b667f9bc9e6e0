"""Ranges of every value that reaches an agent from the wire, in one place.

Steps, sequence numbers, sizes and counts fit in 2^53 (a float64 holds them exactly, and
any sum or lead the agent adds stays far below int64); durations are finite and at most a
day; timestamps are finite, not negative, and not more than a day ahead of this machine's
clock.  Strings are length-capped; labels may not hold control characters, and free text
(a checkpoint's path or error) is cut and stripped of them.

Each check raises :class:`Rejected` (a ``ValueError``) with one of
:data:`REASONS` as its metric label, so ``rankwatch_messages_rejected_total`` stays a
bounded set of series whatever arrives.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from rankwatch.proto import pb

__all__ = [
    "MAX_DURATION", "MAX_RECOVERY_SECONDS", "MAX_STEP", "MAX_TEXT", "RECOVERY_PHASES", "REASONS",
    "check_checkpoints", "check_recovery", "check_summary", "check_timestamp", "clean_text", "reason_label",
]

MAX_STEP = 1 << 53
"""Exclusive bound of steps, sequence numbers, byte sizes, pids and counters."""
MAX_DURATION = 86400.0
"""Seconds: no step, collective, save or stall on the wire lasts longer than a day."""
MAX_CLOCK_AHEAD = 86400.0
"""A timestamp may be this far ahead of the agent's clock (skew between hosts)."""
MAX_LABEL = 128
MAX_ADDRESS = 300   # HOST:PORT, a fully qualified host name included (253 characters at most)
MAX_TEXT = 1024
"""Free text (a checkpoint's error or path) is cut to this many characters."""
MAX_CHECKPOINTS_PER_BATCH = 64
MAX_RECOVERIES_PER_BATCH = 16
MAX_DROPPED_NODES = 1024
MAX_STACKS = 256 << 10
MAX_SUMMARY_RANKS = 4096
MAX_WORLD_SIZE = 1 << 20
MAX_RECORDS_PER_BATCH = 65536
MAX_OP_NAMES = 64
MAX_SUMMARY_INCIDENTS = 1024
MAX_SUMMARY_DECISIONS = 1024
MAX_DETAIL_JSON = 64 << 10
MAX_WINDOW = 1024
MAX_RECOVERY_SECONDS = 3600.0
"""An in-process recovery that took longer than an hour is no fast tier: its phases are refused."""
RECOVERY_PHASES = ("left_step", "agreed", "reinitialised", "restored", "first_step")
"""The phases of an in-process recovery, in order; each is seconds since the failure was caught."""

REASONS = (
    "undecodable", "no_hello", "invalid_hello", "unknown_rank", "duplicate_rank", "too_many_ranks",
    "duplicate_batch", "stale_stream", "oversized", "malformed", "invalid_value", "unauthenticated",
    "pid_not_peer", "uid_not_agent", "too_many_nodes", "other",
)
"""Every ``reason`` label of ``rankwatch_messages_rejected_total``."""

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_NOT_LABEL = re.compile(r"[\x00-\x1f\x7f-\x9f]")   # control characters, newline and tab included


def reason_label(reason: str) -> str:
    """The metric label of a rejection reason: one of :data:`REASONS`."""
    return reason if reason in REASONS else "other"


class Rejected(ValueError):
    """A message the agent refuses; ``reason`` is a short metric label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def _reject(reason: str, detail: str) -> Rejected:
    return Rejected(reason, detail)


def clean_text(value: str, limit: int = MAX_TEXT) -> str:
    """``value`` without control characters (newline and tab kept), cut to ``limit``."""
    if len(value) > limit:
        value = value[:limit] + "…"
    return _CONTROL.sub("", value)


def check_count(value: int, what: str, lo: int = 0) -> None:
    if not lo <= value < MAX_STEP:
        raise _reject("invalid_value", f"{what} {value} outside [{lo}, 2^53)")


def check_duration(value: float, what: str) -> None:
    if not (math.isfinite(value) and 0.0 <= value <= MAX_DURATION):
        raise _reject("invalid_value", f"{what} {value!r} is not a duration in [0, {MAX_DURATION:.0f}] s")


def check_timestamp(value: float, what: str, now: float | None = None) -> None:
    """Unix seconds: finite, not negative, at most a day ahead of ``now`` (0 means unset)."""
    limit = (time.time() if now is None else now) + MAX_CLOCK_AHEAD
    if not (math.isfinite(value) and 0.0 <= value <= limit):
        raise _reject("invalid_value", f"{what} {value!r} is not a plausible Unix time")


def check_label(value: str, what: str, reason: str = "invalid_value") -> None:
    if len(value) > MAX_LABEL or _NOT_LABEL.search(value):
        raise _reject(reason, f"{what} is too long or has control characters")


def check_durations(values: Sequence[float], what: str) -> None:
    """:func:`check_duration` of each value, for the hundreds of a summary's windows: by the
    same bounds in three C-level passes (a NaN may slip past min and max, never past the sum;
    nor may an infinity), value by value only to name one out of range."""
    if values and not (0.0 <= min(values) and max(values) <= MAX_DURATION and math.isfinite(sum(values))):
        for value in values:
            check_duration(value, what)


# -- rank streams ---------------------------------------------------------------

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
        raise _reject("oversized", f"{n} collective records in one batch")
    cols = {}
    for name, dtype in _COLUMNS:
        raw = getattr(c, name)
        if len(raw) != n * dtype.itemsize:
            raise _reject("malformed", f"collective column {name} has {len(raw)} bytes for {n} records")
        cols[name] = np.frombuffer(raw, dtype=dtype)
    if n and int(_MAX(cols["op"])) >= n_ops:
        raise _reject("malformed", "collective op code outside the rank's op names")
    return cols


def check_step_shapes(s: pb.StepColumns) -> pb.StepColumns:
    """Step columns of one length, finite and not negative (their ranges: :func:`check_step_columns`)."""
    n = len(s.step)
    if n > MAX_RECORDS_PER_BATCH:
        raise _reject("oversized", f"{n} step records in one batch")
    fields = (s.start, s.duration, s.data, s.forward, s.backward, s.optimizer, s.tokens, s.flops)
    if any(len(f) != n for f in fields) or len(s.wait) not in (0, n):
        raise _reject("malformed", "step columns of different lengths")
    if s.wait and (not all(math.isfinite(w) and w >= 0 for w in s.wait)):
        raise _reject("invalid_value", "step wait is NaN, infinite or negative")
    if n == 0:
        raise _reject("malformed", "empty step columns")
    arr = np.array(fields, dtype=np.float64)
    if not np.all(np.isfinite(arr)) or (arr[1:] < 0).any() or min(s.step) < 0:
        raise _reject("invalid_value", "step value is NaN, infinite or negative")
    return s


def parse_flight_recorder(text: str) -> dict | None:
    """A rank's Flight Recorder extract (``Progress.flight_recorder``), checked field by field.

    Returns ``{"pending": [{group, desc, seq, op, state, since}], "completed": {group: seq},
    "enqueued": {group: seq}}``, None for an empty string; raises ValueError for anything else.
    """
    if not text:
        return None
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    pending = doc.get("pending", [])
    if not isinstance(pending, list) or len(pending) > 256:
        raise ValueError("'pending' must be a list (at most 256)")
    out: dict = {"pending": [], "completed": {}, "enqueued": {}}
    for e in pending:
        if not isinstance(e, dict):
            raise ValueError("a pending entry is not an object")
        try:
            labels = {k: str(e[k]) if k in ("group", "op") else str(e.get(k, ""))
                      for k in ("group", "desc", "op", "state")}
            seq, since = int(e["seq"]), float(e["since"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"bad pending entry ({exc!r})") from None
        for label in labels.values():
            _fr_label(label)
        if not math.isfinite(since):
            raise ValueError("pending entry time is NaN or infinite")
        out["pending"].append({"group": labels["group"], "desc": labels["desc"], "seq": seq,
                               "op": labels["op"], "state": labels["state"], "since": since})
    for key in ("completed", "enqueued"):
        seqs = doc.get(key, {})
        if not isinstance(seqs, dict) or len(seqs) > 256:
            raise ValueError(f"'{key}' must be an object (at most 256 groups)")
        for group, seq in seqs.items():
            _fr_label(group)
            if not isinstance(seq, int) or isinstance(seq, bool):
                raise ValueError(f"'{key}' sequence numbers must be integers")
            out[key][group] = seq
    return out


def _fr_label(value: str) -> None:
    if len(value) > MAX_LABEL or any(ord(c) < 32 for c in value):
        raise ValueError("a group or op name is too long or has control characters")


def check_progress_shape(p: pb.Progress) -> None:
    """A progress record's times finite, its sizes capped, its Flight Recorder extract parsed."""
    if not (math.isfinite(p.step_started_at) and math.isfinite(p.sampled_at)
            and math.isfinite(p.inflight.since)):
        raise _reject("invalid_value", "progress time is NaN or infinite")
    if len(p.group_seqs) > 256 or len(p.stacks) > MAX_STACKS or len(p.flight_recorder) > MAX_STACKS:
        raise _reject("oversized", "too many groups, too long stacks or Flight Recorder in progress")
    if p.flight_recorder:
        try:
            parse_flight_recorder(p.flight_recorder)
        except ValueError as exc:
            raise _reject("malformed", f"flight_recorder: {exc}") from None
    for name in list(p.group_seqs) + [p.inflight.op, p.inflight.group]:
        check_label(name, "a group or op name", "invalid_hello")
    if p.step_started_at < 0 or p.step < -1:
        raise _reject("invalid_value", "negative progress")



def check_hello(msg: pb.Hello) -> None:
    """A rank's hello: its world, rank, pid, names and mesh."""
    if not 0 < msg.world_size <= MAX_WORLD_SIZE:
        raise _reject("invalid_hello", f"world_size {msg.world_size} out of range")
    if not 0 <= msg.rank < msg.world_size:
        raise _reject("unknown_rank", f"rank {msg.rank} not in [0, {msg.world_size})")
    if msg.local_rank < 0 or msg.pid <= 0:
        raise _reject("invalid_hello", f"local_rank {msg.local_rank} / pid {msg.pid} invalid")
    if len(msg.op_names) > MAX_OP_NAMES or len(msg.mesh_coords) > 16 or len(msg.mesh_shape) > 16:
        raise _reject("invalid_hello", "too many op names or mesh dimensions")
    if not math.isfinite(msg.peak_flops) or msg.peak_flops < 0:
        raise _reject("invalid_hello", f"peak_flops {msg.peak_flops} invalid")
    for value in (msg.node_id, msg.backend, msg.device, msg.device_uuid, msg.collective_source,
                  msg.job_id, *msg.op_names, *msg.mesh_coords, *msg.mesh_shape):
        check_label(value, "a name in the hello", "invalid_hello")
    if msg.pid >= 1 << 32:
        raise _reject("invalid_hello", f"pid {msg.pid} out of range")
    for coords in (msg.mesh_coords, msg.mesh_shape):
        for value in coords.values():
            if not 0 <= value < 1 << 20:
                raise _reject("invalid_hello", f"mesh coordinate {value} out of range")


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
                raise _reject("malformed", f"flight_recorder: {exc}") from None
    check_checkpoints(batch.checkpoints, now)
    if len(batch.recoveries) > MAX_RECOVERIES_PER_BATCH:
        raise _reject("oversized", f"{len(batch.recoveries)} recovery records in one batch")


def check_step_columns(s: pb.StepColumns, now: float | None = None) -> None:
    """Ranges of step columns whose lengths and signs are checked already."""
    now = time.time() if now is None else now
    steps = np.asarray(s.step, np.int64)
    if steps.size and int(steps.max()) >= MAX_STEP:
        raise _reject("invalid_value", "step number outside [0, 2^53)")
    durations = np.array((s.duration, s.data, s.forward, s.backward, s.optimizer), np.float64)
    if durations.size and float(durations.max()) > MAX_DURATION:
        raise _reject("invalid_value", f"step time over {MAX_DURATION:.0f} s")
    if s.wait and max(s.wait) > MAX_DURATION:
        raise _reject("invalid_value", f"step wait over {MAX_DURATION:.0f} s")
    if s.start and (max(s.start) > now + MAX_CLOCK_AHEAD):
        raise _reject("invalid_value", "step start is not a plausible Unix time")
    for col, what in ((s.tokens, "tokens"), (s.flops, "flops")):
        if col and max(col) >= 1e30:
            raise _reject("invalid_value", f"{what} per step implausibly large")


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
        raise _reject("invalid_value", "collective duration or start is NaN, infinite or negative")
    if (nbytes < 0).any():
        raise _reject("invalid_value", "negative collective size")
    if int(seq.max()) >= MAX_STEP or int(seq.min()) < -1:
        raise _reject("invalid_value", "collective sequence number outside [-1, 2^53)")
    if int(nbytes.max()) >= MAX_STEP:
        raise _reject("invalid_value", "collective size over 2^53 bytes")
    if float(d.max()) > MAX_DURATION:
        raise _reject("invalid_value", f"collective duration over {MAX_DURATION:.0f} s")
    if float(start.min()) < 0 or float(start.max()) > now + MAX_CLOCK_AHEAD:
        raise _reject("invalid_value", "collective start is not a plausible Unix time")


def check_progress(p: pb.Progress, now: float | None = None) -> None:
    """Ranges of a rank's progress sample (finiteness and sizes are checked already)."""
    check_count(p.step, "progress step", lo=-1)
    check_count(p.last_collective_seq, "last_collective_seq", lo=-1)
    for t, what in ((p.step_started_at, "step_started_at"), (p.sampled_at, "sampled_at")):
        check_timestamp(t, what, now)
    for value in p.group_seqs.values():
        check_count(value, "group sequence number", lo=-1)
    if p.HasField("inflight"):
        check_count(p.inflight.seq, "in-flight sequence number", lo=-1)
        check_timestamp(p.inflight.since, "in-flight since", now)


def check_flight_recorder(doc: dict[str, Any], now: float | None = None) -> None:
    """Ranges of a parsed Flight Recorder extract (:func:`state.parse_flight_recorder`).

    Raises:
        ValueError: a sequence number or time out of range.
    """
    for e in doc["pending"]:
        if not -1 <= e["seq"] < MAX_STEP:
            raise ValueError(f"pending sequence number {e['seq']} outside [-1, 2^53)")
        check_timestamp(e["since"], "pending since", now)
        for key in ("desc", "state"):
            check_label(e[key], f"pending {key}")
    for key in ("completed", "enqueued"):
        for seq in doc[key].values():
            if not -1 <= seq < MAX_STEP:
                raise ValueError(f"'{key}' sequence number {seq} outside [-1, 2^53)")


def check_checkpoints(records: Iterable[pb.CheckpointRecord], now: float | None = None) -> None:
    """A batch's checkpoint records: each step, time and duration in range.

    Their strings are not refused but cut and cleaned where they are kept (:func:`clean_text`).
    """
    if not records:   # a batch's repeated field: most batches have none
        return
    records = list(records)
    if len(records) > MAX_CHECKPOINTS_PER_BATCH:
        raise _reject("oversized", f"{len(records)} checkpoint records in one batch")
    for rec in records:
        check_count(rec.step, "checkpoint step")
        check_timestamp(rec.started_at, "checkpoint started_at", now)
        check_duration(rec.duration, "checkpoint duration")
        check_duration(rec.completed_after, "checkpoint completed_after")
        if len(rec.request_id) > MAX_LABEL:
            raise _reject("invalid_value", "checkpoint request_id too long")


def check_recovery(rec: pb.RecoveryRecord, now: float | None = None) -> None:
    """One in-process recovery record: its time, step, worlds, dropped nodes and phases.

    Checked one record at a time (:meth:`NodeState.take_recoveries`): a bad record is refused
    alone, the batch that carried it is kept.  Its error text is not refused but cut and
    cleaned where it is kept (:func:`clean_text`), as a checkpoint's is.
    """
    check_timestamp(rec.started_at, "recovery started_at", now)
    if rec.started_at <= 0:
        raise _reject("invalid_value", "recovery started_at is unset")
    check_count(rec.step, "recovery step", lo=-1)
    if not 0 < rec.old_world_size <= MAX_WORLD_SIZE:
        raise _reject("invalid_value", f"recovery old_world_size {rec.old_world_size} out of range")
    lowest = 1 if rec.ok else 0   # a failed attempt may end before the new world is known
    if not lowest <= rec.new_world_size <= MAX_WORLD_SIZE:
        raise _reject("invalid_value", f"recovery new_world_size {rec.new_world_size} out of range")
    if rec.ok and not 0 <= rec.rank_after < rec.new_world_size:
        raise _reject("invalid_value", f"recovery rank_after {rec.rank_after} not in [0, {rec.new_world_size})")
    if not rec.ok and not -1 <= rec.rank_after < max(rec.new_world_size, 1):
        raise _reject("invalid_value", f"failed recovery rank_after {rec.rank_after} out of range")
    if len(rec.dropped_nodes) > MAX_DROPPED_NODES:
        raise _reject("oversized", f"{len(rec.dropped_nodes)} dropped nodes in one recovery")
    for node in rec.dropped_nodes:
        check_label(node, "a recovery's dropped node")
    _check_recovery_phases(rec.phases)


def _check_recovery_phases(phases: Any) -> None:
    """Known phase names only; each finite, in [0, MAX_RECOVERY_SECONDS], and none before
    an earlier phase (they are cumulative)."""
    unknown = set(phases) - set(RECOVERY_PHASES)
    if unknown:
        raise _reject("invalid_value", f"unknown recovery phase {clean_text(sorted(unknown)[0], 64)!r}")
    last, last_name = 0.0, "started_at"
    for name in RECOVERY_PHASES:
        if name not in phases:
            continue
        value = phases[name]
        if not (math.isfinite(value) and 0.0 <= value <= MAX_RECOVERY_SECONDS):
            raise _reject("invalid_value", f"recovery phase {name} {value!r} is not in "
                                           f"[0, {MAX_RECOVERY_SECONDS:.0f}] s")
        if value < last:
            raise _reject("invalid_value", f"recovery phase {name} ({value:.6g} s) ends before "
                                           f"{last_name} ({last:.6g} s)")
        last, last_name = value, name


# -- node summaries (Sync) -------------------------------------------------------

def check_summary(s: pb.NodeSummary, now: float | None = None) -> None:
    """A node's summary, as the coordinator takes it in ``Sync``.

    Raises:
        Rejected: a count, value or string out of range (nothing of the summary is kept).
    """
    now = time.time() if now is None else now
    check_label(s.node_id, "node_id", "malformed")
    check_label(s.run_id, "run_id", "malformed")
    if len(s.relay_address) > MAX_ADDRESS or _NOT_LABEL.search(s.relay_address):
        raise _reject("malformed", "relay_address is too long or has control characters")
    check_count(s.seq, "summary seq")
    check_timestamp(s.sent_at, "summary sent_at", now)
    if (len(s.ranks) > MAX_SUMMARY_RANKS or len(s.incidents) > MAX_SUMMARY_INCIDENTS
            or len(s.decisions) > MAX_SUMMARY_DECISIONS or len(s.time_seconds) > 64):
        raise _reject("oversized", "too many ranks, incidents, decisions or accounts in a summary")
    for key, value in s.time_seconds.items():
        check_label(key, "a time account")
        if not (math.isfinite(value) and 0 <= value < 1e10):
            raise _reject("invalid_value", f"time account {key} {value!r} out of range")
    for r in s.ranks:
        _check_rank_summary(r, now)
    for i in s.incidents:
        check_incident(i, now)
    for d in s.decisions:
        check_label(d.id, "decision id")
        check_label(d.kind, "decision kind")
        check_label(d.node, "decision node")
        check_label(d.run_id, "decision run_id")
        check_count(d.generation, "decision generation")
        check_count(d.step, "decision step")
        check_count(d.seq, "decision seq")
        check_timestamp(d.decided_at, "decision time", now)
        if len(d.reason) > MAX_TEXT:
            raise _reject("invalid_value", "decision reason too long")


def check_beat(b: pb.NodeBeat, now: float | None = None) -> None:
    """A relay's word that a node was heard (``SyncGroup``)."""
    now = time.time() if now is None else now
    check_label(b.node_id, "node_id", "malformed")
    check_count(b.seq, "beat seq")
    check_timestamp(b.sent_at, "beat sent_at", now)
    check_timestamp(b.latest_progress, "beat latest_progress", now)


def _check_rank_summary(r: pb.RankSummary, now: float) -> None:
    check_count(r.rank, "rank")
    check_count(r.pid, "pid")
    check_count(r.step, "step", lo=-1)
    check_count(r.steps_completed, "steps_completed")
    check_count(r.local_rank, "local_rank")
    if not 0 <= r.world_size <= MAX_WORLD_SIZE:
        raise _reject("invalid_value", f"world_size {r.world_size} out of range")
    if r.HasField("world_rank") and not 0 <= r.world_rank < MAX_WORLD_SIZE:
        raise _reject("invalid_value", f"world_rank {r.world_rank} out of range")
    check_duration(r.step_seconds, "step_seconds")
    for t, what in ((r.progress_at, "progress_at"), (r.last_seen, "last_seen"), (r.stacks_at, "stacks_at")):
        check_timestamp(t, what, now)
    check_label(r.activity, "activity")
    check_label(r.state, "state")
    if not (math.isfinite(r.tokens_per_second) and 0 <= r.tokens_per_second < 1e30):
        raise _reject("invalid_value", "tokens_per_second out of range")
    if len(r.group_seqs) > 256:
        raise _reject("oversized", "too many groups in a rank summary")
    for group, seq in r.group_seqs.items():
        check_label(group, "group name")
        check_count(seq, "group sequence number", lo=-1)
    if r.HasField("inflight"):
        check_label(r.inflight.op, "in-flight op")
        check_label(r.inflight.group, "in-flight group")
        check_count(r.inflight.seq, "in-flight sequence number", lo=-1)
        check_timestamp(r.inflight.since, "in-flight since", now)
    own, data, comm = r.own_work, r.data_wait, r.comm_wait
    if len(own) > MAX_WINDOW or len(data) > MAX_WINDOW or len(comm) > MAX_WINDOW:
        raise _reject("oversized", "rank summary window too long")
    check_durations(own[:] + data[:] + comm[:], "a per-step time")   # [:]: a list, copied in C
    if len(r.stacks) > MAX_STACKS or len(r.flight_recorder) > MAX_STACKS:
        raise _reject("oversized", "rank summary stacks or Flight Recorder too long")
    if r.flight_recorder:
        try:
            doc = parse_flight_recorder(r.flight_recorder)
            if doc is not None:
                check_flight_recorder(doc, now)
        except ValueError as exc:
            raise _reject("malformed", f"flight_recorder: {exc}") from None


def check_incident(i: pb.Incident, now: float | None = None) -> None:
    """An incident a node reports in its summary."""
    for value, what in ((i.id, "incident id"), (i.kind, "incident kind"), (i.node, "incident node"),
                        (i.run_id, "incident run_id")):
        check_label(value, what)
    check_count(i.rank, "incident rank", lo=-1)
    check_count(i.step, "incident step", lo=-1)
    check_timestamp(i.detected_at, "incident detected_at", now)
    if len(i.detail_json) > MAX_DETAIL_JSON:
        raise _reject("oversized", f"incident detail over {MAX_DETAIL_JSON} bytes")
    try:
        detail = json.loads(i.detail_json or "{}")
    except (ValueError, RecursionError):
        raise _reject("malformed", "incident detail is not JSON") from None
    if not isinstance(detail, dict):
        raise _reject("malformed", "incident detail is not a JSON object")
    if not _finite(detail):
        raise _reject("invalid_value", "incident detail holds NaN, infinity or a number beyond 2^53")
    for key in _DETAIL_DURATIONS:   # what goodput and the views read as times
        if isinstance(detail.get(key), (int, float)) and not isinstance(detail[key], bool):
            check_duration(float(detail[key]), f"incident {key}")
    for key in _DETAIL_TIMES:
        if isinstance(detail.get(key), (int, float)) and not isinstance(detail[key], bool):
            check_timestamp(float(detail[key]), f"incident {key}", now)
    if "phases" in detail:   # an in-process recovery's, which goodput reads
        phases = detail["phases"]
        if not (isinstance(phases, dict) and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                 for v in phases.values())):
            raise _reject("malformed", "incident phases are not an object of seconds")
        _check_recovery_phases(phases)


_DETAIL_DURATIONS = ("seconds", "complete_seconds", "stalled_seconds", "recovered_after_seconds",
                     "allowance_seconds")
_DETAIL_TIMES = ("started_at", "resolved_at")


def _finite(value: Any, depth: int = 0) -> bool:
    if depth > 16:
        return False
    if isinstance(value, float):
        return math.isfinite(value) and abs(value) < 1e300
    if isinstance(value, int):
        return abs(value) < MAX_STEP
    if isinstance(value, dict):
        return all(_finite(v, depth + 1) for v in value.values())
    if isinstance(value, list):
        return all(_finite(v, depth + 1) for v in value)
    return True
