"""Ranges of every value that reaches an agent from the wire: the bounds and the checks
that every message uses.

Steps, sequence numbers, sizes and counts fit in 2^53 (a float64 holds them exactly, and
any sum or lead the agent adds stays far below int64); durations are finite and at most a
day; timestamps are finite, not negative, and not more than a day ahead of this machine's
clock.  Strings are length-capped; labels may not hold control characters, and free text
(a checkpoint's path or error) is cut and stripped of them.

Each check raises :class:`Rejected` (a ``ValueError``) with one of
:data:`REASONS` as its metric label, so ``rankwatch_messages_rejected_total`` stays a
bounded set of series whatever arrives.  What a rank's stream carries is checked in
:mod:`wire.report`, what a node's sync carries in :mod:`wire.summary`; the Flight
Recorder extract and a recovery's phases, which both carry, are checked here.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Sequence
from typing import Any

__all__ = [
    "MAX_DURATION", "MAX_EXPERTS", "MAX_RECOVERY_SECONDS", "MAX_STEP", "MAX_TEXT", "REASONS", "RECOVERY_PHASES", "Rejected",
    "check_count", "check_duration", "check_durations", "check_flight_recorder", "check_label",
    "check_recovery_phases", "check_timestamp", "clean_text", "parse_flight_recorder", "reason_label",
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
MAX_EXPERTS = 256
"""Local experts a rank reports the load of (the hooks cut the rest)."""
MAX_RECORDS_PER_BATCH = 65536
MAX_OP_NAMES = 64
MAX_GROUP_NAMES = 256   # process-group names in one batch's collective columns (MAX_LABEL characters each)
MAX_SUMMARY_INCIDENTS = 1024
MAX_SUMMARY_DECISIONS = 1024
MAX_DETAIL_JSON = 64 << 10
MAX_WINDOW = 1024
MAX_RECOVERY_SECONDS = 3600.0
"""An in-process recovery that took longer than an hour is no fast tier: its phases are refused."""
RECOVERY_PHASES = ("left_step", "agreed", "reinitialised", "resharded", "reloaded", "restored", "first_step")
"""The phases of an in-process recovery, in order; each is seconds since the failure was caught
(``resharded`` only in a recovery from peer snapshots, ``reloaded`` only in one from the
newest checkpoint, loaded in process)."""

REASONS = (
    "undecodable", "no_hello", "invalid_hello", "unknown_rank", "duplicate_rank", "too_many_ranks",
    "duplicate_batch", "stale_stream", "oversized", "malformed", "invalid_value", "unauthenticated",
    "pid_not_peer", "uid_not_agent", "too_many_nodes", "node_taken", "rank_conflict", "other",
)
"""Every ``reason`` label of ``rankwatch_messages_rejected_total``."""

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
NOT_LABEL = re.compile(r"[\x00-\x1f\x7f-\x9f]")   # control characters, newline and tab included


def reason_label(reason: str) -> str:
    """The metric label of a rejection reason: one of :data:`REASONS`."""
    return reason if reason in REASONS else "other"


class Rejected(ValueError):
    """A message the agent refuses; ``reason`` is a short metric label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def clean_text(value: str, limit: int = MAX_TEXT) -> str:
    """``value`` without control characters (newline and tab kept), cut to ``limit``."""
    if len(value) > limit:
        value = value[:limit] + "…"
    return _CONTROL.sub("", value)


def check_count(value: int, what: str, lo: int = 0) -> None:
    if not lo <= value < MAX_STEP:
        raise Rejected("invalid_value", f"{what} {value} outside [{lo}, 2^53)")


def check_duration(value: float, what: str) -> None:
    if not (math.isfinite(value) and 0.0 <= value <= MAX_DURATION):
        raise Rejected("invalid_value", f"{what} {value!r} is not a duration in [0, {MAX_DURATION:.0f}] s")


def check_timestamp(value: float, what: str, now: float | None = None) -> None:
    """Unix seconds: finite, not negative, at most a day ahead of ``now`` (0 means unset)."""
    limit = (time.time() if now is None else now) + MAX_CLOCK_AHEAD
    if not (math.isfinite(value) and 0.0 <= value <= limit):
        raise Rejected("invalid_value", f"{what} {value!r} is not a plausible Unix time")


def check_label(value: str, what: str, reason: str = "invalid_value") -> None:
    if len(value) > MAX_LABEL or NOT_LABEL.search(value):
        raise Rejected(reason, f"{what} is too long or has control characters")


def check_durations(values: Sequence[float], what: str) -> None:
    """:func:`check_duration` of each value, for the hundreds of a summary's windows: by the
    same bounds in three C-level passes (a NaN may slip past min and max, never past the sum;
    nor may an infinity), value by value only to name one out of range."""
    if values and not (0.0 <= min(values) and max(values) <= MAX_DURATION and math.isfinite(sum(values))):
        for value in values:
            check_duration(value, what)


# -- what both a rank's stream and a node's sync carry --------------------------

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


def check_recovery_phases(phases: Any) -> None:
    """Known phase names only; each finite, in [0, MAX_RECOVERY_SECONDS], and none before
    an earlier phase (they are cumulative)."""
    unknown = set(phases) - set(RECOVERY_PHASES)
    if unknown:
        raise Rejected("invalid_value", f"unknown recovery phase {clean_text(sorted(unknown)[0], 64)!r}")
    last, last_name = 0.0, "started_at"
    for name in RECOVERY_PHASES:
        if name not in phases:
            continue
        value = phases[name]
        if not (math.isfinite(value) and 0.0 <= value <= MAX_RECOVERY_SECONDS):
            raise Rejected("invalid_value", f"recovery phase {name} {value!r} is not in "
                                           f"[0, {MAX_RECOVERY_SECONDS:.0f}] s")
        if value < last:
            raise Rejected("invalid_value", f"recovery phase {name} ({value:.6g} s) ends before "
                                           f"{last_name} ({last:.6g} s)")
        last, last_name = value, name
