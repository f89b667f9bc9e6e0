"""Ranges of what a node sends its coordinator: its summary in ``Sync`` (ranks, incidents,
decisions, time accounts), and a relay's beats in ``SyncGroup`` (bounds: :mod:`validate`).
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

import numpy as np

from rankwatch.agent.wire.ranges import (
    MAX_ADDRESS, MAX_CLOCK_AHEAD, MAX_DETAIL_JSON, MAX_DURATION, MAX_STACKS, MAX_STEP, MAX_SUMMARY_DECISIONS, MAX_SUMMARY_INCIDENTS,
    MAX_LABEL, MAX_OP_NAMES, MAX_SUMMARY_RANKS, MAX_TEXT, MAX_WINDOW, MAX_WORLD_SIZE, NOT_LABEL, Rejected, check_count, check_duration,
    check_durations, check_flight_recorder, check_label, check_recovery_phases, check_timestamp,
    parse_flight_recorder,
)
from rankwatch.agent.wire import inflight as in_flight, windows
from rankwatch.proto import pb

__all__ = ["check_absence", "check_beat", "check_incident", "check_makeup", "check_summary"]


def check_summary(s: pb.NodeSummary, now: float | None = None) -> None:
    """A node's summary, as the coordinator takes it in ``Sync``.

    Raises:
        Rejected: a count, value or string out of range (nothing of the summary is kept).
    """
    now = time.time() if now is None else now
    check_label(s.node_id, "node_id", "malformed")
    check_label(s.run_id, "run_id", "malformed")
    check_label(s.agent_instance, "agent_instance", "malformed")
    if len(s.relay_address) > MAX_ADDRESS or NOT_LABEL.search(s.relay_address):
        raise Rejected("malformed", "relay_address is too long or has control characters")
    check_count(s.seq, "summary seq")
    check_timestamp(s.sent_at, "summary sent_at", now)
    if (len(s.ranks) > MAX_SUMMARY_RANKS or len(s.incidents) > MAX_SUMMARY_INCIDENTS
            or len(s.decisions) > MAX_SUMMARY_DECISIONS or len(s.time_seconds) > 64):
        raise Rejected("oversized", "too many ranks, incidents, decisions or accounts in a summary")
    for key, value in s.time_seconds.items():
        check_label(key, "a time account")
        if not (math.isfinite(value) and 0 <= value < 1e10):
            raise Rejected("invalid_value", f"time account {key} {value!r} out of range")
    # Every rank's packed windows, checked in one pass (ufunc reductions: numpy's min and max
    # wrap them in Python).
    work = windows.all_windows([_check_rank_summary(r, now) for r in s.ranks])
    if work.size and not (0.0 <= np.minimum.reduce(work) and np.maximum.reduce(work) <= MAX_DURATION):   # NaN fails both
        check_durations(work.tolist(), "a per-step time")   # names the value
        raise Rejected("invalid_value", "a per-step time out of range")
    if s.HasField("step_makeup"):
        check_makeup(s.step_makeup)
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
            raise Rejected("invalid_value", "decision reason too long")


def check_makeup(m: pb.StepMakeup) -> None:
    """A node's ranks' step make-up (the job's bottleneck reads it): durations in range, the
    ranks within a summary's, the critical ones among those seen, a utilisation in [0, 1]."""
    for value, what in ((m.step_seconds, "makeup step"), (m.data_seconds, "makeup data"),
                        (m.wait_seconds, "makeup wait"), (m.own_seconds, "makeup own work")):
        check_duration(value, what)
    if not (m.ranks <= m.ranks_seen <= MAX_SUMMARY_RANKS and m.steps <= MAX_WINDOW):
        raise Rejected("invalid_value", f"makeup of {m.ranks}/{m.ranks_seen} ranks, {m.steps} steps out of range")
    if m.HasField("gpu_utilization") and not 0.0 <= m.gpu_utilization <= 1.0:   # (NaN fails)
        raise Rejected("invalid_value", f"makeup gpu_utilization {m.gpu_utilization!r} outside [0, 1]")


def check_beat(b: pb.NodeBeat, now: float | None = None) -> None:
    """A relay's word that a node was heard (``SyncGroup``)."""
    now = time.time() if now is None else now
    check_label(b.node_id, "node_id", "malformed")
    check_count(b.seq, "beat seq")
    check_timestamp(b.sent_at, "beat sent_at", now)
    check_timestamp(b.latest_progress, "beat latest_progress", now)


def check_absence(a: pb.NodeAbsence) -> None:
    """A relay's word that a member of its group has gone unheard (``SyncGroup``)."""
    check_label(a.node_id, "node_id", "malformed")
    if not a.node_id:
        raise Rejected("malformed", "an absence without node_id")
    check_duration(a.unheard_seconds, "unheard_seconds")


def _check_rank_summary(r: pb.RankSummary, now: float) -> bytes:
    """Range-checks a rank of a node's summary; returns its packed windows (``work``), whose
    values the caller checks with every other rank's."""
    # Every number in range, in one expression; only a value out of range goes through the
    # checks that name it.  (A coordinator range-checks thousands of ranks a second at 2,048
    # nodes: a call per value cost it a quarter more time.)  NaN fails every comparison, and every
    # bound is finite, so this passes exactly what the checks below pass.  (An unset world_rank
    # reads 0.)
    limit = now + MAX_CLOCK_AHEAD
    if not (0 <= r.rank < MAX_STEP and 0 <= r.pid < MAX_STEP and -1 <= r.step < MAX_STEP
            and 0 <= r.steps_completed < MAX_STEP and 0 <= r.local_rank < MAX_STEP
            and 0 <= r.world_size <= MAX_WORLD_SIZE and 0 <= r.world_rank < MAX_WORLD_SIZE
            and 0.0 <= r.step_seconds <= MAX_DURATION and 0.0 <= r.step_period <= MAX_DURATION
            and 0.0 <= r.progress_at <= limit and 0.0 <= r.last_seen <= limit and 0.0 <= r.stacks_at <= limit
            and 0.0 <= r.tokens_per_second < 1e30 and 0.0 <= r.expert_tokens < MAX_STEP):   # (unset: 0)
        _check_rank_numbers(r, now)
    check_label(r.activity, "activity")
    check_label(r.state, "state")
    seqs = r.group_seqs
    if len(seqs) > 256:
        raise Rejected("oversized", "too many groups in a rank summary")
    for group in seqs:   # (keys, then each value: a map's items() is Python-level, twice the time)
        seq = seqs[group]
        if len(group) > MAX_LABEL or NOT_LABEL.search(group) or not -1 <= seq < MAX_STEP:
            check_label(group, "group name")
            check_count(seq, "group sequence number", lo=-1)
    return _check_rank_rest(r, now)


def _check_rank_numbers(r: pb.RankSummary, now: float) -> None:
    """Names the number of ``r`` out of range (raises :class:`Rejected`)."""
    check_count(r.rank, "rank")
    check_count(r.pid, "pid")
    check_count(r.step, "step", lo=-1)
    check_count(r.steps_completed, "steps_completed")
    check_count(r.local_rank, "local_rank")
    if not 0 <= r.world_size <= MAX_WORLD_SIZE:
        raise Rejected("invalid_value", f"world_size {r.world_size} out of range")
    if not 0 <= r.world_rank < MAX_WORLD_SIZE:
        raise Rejected("invalid_value", f"world_rank {r.world_rank} out of range")
    check_duration(r.step_seconds, "step_seconds")
    check_duration(r.step_period, "step_period")
    for t, what in ((r.progress_at, "progress_at"), (r.last_seen, "last_seen"), (r.stacks_at, "stacks_at")):
        check_timestamp(t, what, now)
    if not (math.isfinite(r.tokens_per_second) and 0 <= r.tokens_per_second < 1e30):
        raise Rejected("invalid_value", "tokens_per_second out of range")
    if not 0 <= r.expert_tokens < MAX_STEP:   # (NaN fails)
        raise Rejected("invalid_value", "expert_tokens out of range")
    raise Rejected("invalid_value", "a rank summary number out of range")   # (the checks above name each)


def _check_rank_extras(r: pb.RankSummary) -> None:
    """What a coordinator's status shows of another node's rank as it came: its backend, time
    per phase, mesh coordinates, collectives and per-op latency."""
    check_label(r.backend, "backend")
    check_count(r.collectives, "collectives")
    if len(r.phase_seconds) > MAX_OP_NAMES or len(r.mesh_coords) > 16 or len(r.op_latency) > MAX_OP_NAMES:
        raise Rejected("oversized", "too many phases, mesh dimensions or ops in a rank summary")
    for name in r.phase_seconds:
        check_label(name, "a phase name")
        value = r.phase_seconds[name]
        if not (math.isfinite(value) and 0 <= value < 1e10):
            raise Rejected("invalid_value", f"phase time {value!r} out of range")
    for name in r.mesh_coords:
        check_label(name, "a mesh dimension")
        if not 0 <= r.mesh_coords[name] < MAX_WORLD_SIZE:
            raise Rejected("invalid_value", f"mesh coordinate {r.mesh_coords[name]} out of range")
    for name in r.op_latency:
        check_label(name, "an op name")
        lat = r.op_latency[name]
        check_count(lat.count, "op count")
        check_count(lat.window, "op window")
        check_duration(lat.p50_seconds, "op p50")
        check_duration(lat.p99_seconds, "op p99")


def _check_rank_rest(r: pb.RankSummary, now: float) -> bytes:
    """What follows a rank's numbers, names and groups: its collective in flight, windows,
    stacks and Flight Recorder extract, and what status shows of it; returns its ``work``."""
    if r.backend or r.collectives or r.phase_seconds or r.mesh_coords or r.op_latency:
        _check_rank_extras(r)
    if r.HasField("inflight"):
        check_label(r.inflight.op, "in-flight op")
        check_label(r.inflight.group, "in-flight group")
        in_flight.check(r.inflight, now)
    work = r.work   # (each read copies it) its values are checked with the whole summary's
    own, data, comm = r.own_work, r.data_wait, r.comm_wait
    if own or data or comm:   # an older agent's form
        if len(own) > MAX_WINDOW or len(data) > MAX_WINDOW or len(comm) > MAX_WINDOW:
            raise Rejected("oversized", "rank summary window too long")
        check_durations(own[:] + data[:] + comm[:], "a per-step time")   # [:]: a list, copied in C
        if work:
            raise Rejected("malformed", "rank summary has its windows both packed and repeated")
    if work:
        steps = windows.steps(work)
        if steps is None:
            raise Rejected("malformed", f"rank summary work of {len(work)} bytes: not whole steps")
        if steps > MAX_WINDOW:
            raise Rejected("oversized", "rank summary window too long")
    if len(r.stacks) > MAX_STACKS or len(r.flight_recorder) > MAX_STACKS:
        raise Rejected("oversized", "rank summary stacks or Flight Recorder too long")
    if r.flight_recorder:
        try:
            doc = parse_flight_recorder(r.flight_recorder)
            if doc is not None:
                check_flight_recorder(doc, now)
        except ValueError as exc:
            raise Rejected("malformed", f"flight_recorder: {exc}") from None
    return work


def check_incident(i: pb.Incident, now: float | None = None) -> None:
    """An incident a node reports in its summary."""
    for value, what in ((i.id, "incident id"), (i.kind, "incident kind"), (i.node, "incident node"),
                        (i.run_id, "incident run_id")):
        check_label(value, what)
    check_count(i.rank, "incident rank", lo=-1)
    check_count(i.step, "incident step", lo=-1)
    check_timestamp(i.detected_at, "incident detected_at", now)
    if len(i.detail_json) > MAX_DETAIL_JSON:
        raise Rejected("oversized", f"incident detail over {MAX_DETAIL_JSON} bytes")
    try:
        detail = json.loads(i.detail_json or "{}")
    except (ValueError, RecursionError):
        raise Rejected("malformed", "incident detail is not JSON") from None
    if not isinstance(detail, dict):
        raise Rejected("malformed", "incident detail is not a JSON object")
    if not _finite(detail):
        raise Rejected("invalid_value", "incident detail holds NaN, infinity or a number beyond 2^53")
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
            raise Rejected("malformed", "incident phases are not an object of seconds")
        check_recovery_phases(phases)


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
