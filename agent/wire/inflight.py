"""A rank's operation in flight (``InFlight``): its ranges, and the dict the detectors read.

One form from the rank's progress to the hang verdict: ``{op, group, seq, since}``, plus
``peer`` (a send or receive's other end, a world rank; -1: any source) and ``microbatch``
with ``microbatch_pass`` (the pipeline microbatch its stage was on) where the rank said so.
"""

from __future__ import annotations

from typing import Any

from rankwatch.agent.wire.ranges import MAX_WORLD_SIZE, Rejected, check_count, check_timestamp
from rankwatch.proto import pb

__all__ = ["PASSES", "check", "to_dict", "to_pb"]

PASSES = ("", "forward", "backward")
"""The pipeline passes a microbatch is named in (``""``: none said)."""


def check(i: pb.InFlight, now: float | None = None) -> None:
    """The ranges of an in-flight record (its names are checked with the message's).

    Raises:
        Rejected: a sequence number, time, peer or microbatch out of range.
    """
    check_count(i.seq, "in-flight sequence number", lo=-1)
    check_timestamp(i.since, "in-flight since", now)
    if i.HasField("peer") and not -1 <= i.peer < MAX_WORLD_SIZE:
        raise Rejected("invalid_value", f"in-flight peer {i.peer} outside [-1, {MAX_WORLD_SIZE})")
    if i.HasField("microbatch") and not 0 <= i.microbatch < MAX_WORLD_SIZE:
        raise Rejected("invalid_value", f"in-flight microbatch {i.microbatch} outside [0, {MAX_WORLD_SIZE})")
    if i.microbatch_pass not in PASSES:
        raise Rejected("invalid_value", "in-flight microbatch pass is neither forward nor backward")


def to_dict(i: pb.InFlight, offset: float = 0.0) -> dict[str, Any]:
    """The detectors' form, ``since`` moved by ``offset`` (onto another clock)."""
    out: dict[str, Any] = {"op": i.op, "group": i.group, "seq": i.seq, "since": i.since + offset}
    if i.HasField("peer"):
        out["peer"] = i.peer
    if i.HasField("microbatch"):
        out["microbatch"] = i.microbatch
        out["microbatch_pass"] = i.microbatch_pass
    return out


def to_pb(d: dict[str, Any]) -> pb.InFlight:
    """The wire form of :func:`to_dict`'s."""
    out = pb.InFlight(op=d["op"], group=d["group"], seq=d["seq"], since=d["since"])
    if d.get("peer") is not None:
        out.peer = d["peer"]
    if d.get("microbatch") is not None:
        out.microbatch = d["microbatch"]
        out.microbatch_pass = d.get("microbatch_pass", "")
    return out
