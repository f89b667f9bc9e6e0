"""The hot path: timestamps appended to bounded buffers.

Everything the training thread does for rankwatch ends here: read a monotonic
clock and append a tuple to a ``collections.deque``.  Serialising and sending
happen on the sender thread (:mod:`rankwatch.hooks.instrument.client`), which drains
these buffers.

Drops are counted without any check on the hot path: every collective record
carries a running index from ``itertools.count``; a full deque silently
discards its oldest entries, and the drainer sees the gap in the indices.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from types import TracebackType
from typing import Any

__all__ = ["MAX_EXPERTS", "OPS", "PHASES", "Recorder", "StepScope"]

MAX_EXPERTS = 256
"""Local experts a rank reports the load of (more are cut)."""

# Collective op names, as codes on the wire (index = code).  Names follow the
# torch.distributed verbs; a gloo Flight Recorder calls reduce_scatter
# "all_reduce" because gloo implements it with one.
OPS: tuple[str, ...] = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "all_to_all",
    "barrier",
    "reduce",
    "gather",
    "scatter",
    "send",
    "recv",
    "all_reduce_coalesced",
    "all_gather_coalesced",
    "reduce_scatter_coalesced",
    "other",
)
OP_CODE: dict[str, int] = {name: i for i, name in enumerate(OPS)}

# Step phases a caller marks, in wire order; time not marked is "other".
PHASES: tuple[str, ...] = ("data", "forward", "backward", "optimizer")

# Rank activity, as in the proto's Phase enum.
ACTIVITY_TRAIN, ACTIVITY_EVAL, ACTIVITY_CHECKPOINT, ACTIVITY_IDLE, ACTIVITY_RECOVERY = 1, 2, 3, 4, 5


class Recorder:
    """Bounded buffers of step and collective records, plus live progress.

    Args:
        capacity: collective records kept before the oldest are dropped.
        step_capacity: step records kept before the oldest are dropped.
    """

    def __init__(self, capacity: int = 1 << 17, step_capacity: int = 1 << 12) -> None:
        self.collectives: deque[tuple] = deque(maxlen=capacity)
        self.steps: deque[tuple] = deque(maxlen=step_capacity)
        # (step, tokens per local expert): a mixture of experts' load, one entry a step.
        self.expert_loads: deque[tuple] = deque(maxlen=step_capacity)
        self._index = itertools.count()
        # Live progress: plain attributes written by the training thread and
        # sampled by the sender thread.
        self.step = -1
        self.step_started_ns = 0
        self.activity = ACTIVITY_IDLE
        # (op code, process group or None, issue ns, a P2P op's peer as passed) of the op the
        # training thread is blocked in, or None.
        self.inflight: tuple | None = None
        self.microbatch: tuple[str, int] | None = None
        self.snapshot: tuple | None = None
        """The peer snapshots' latest stats (:meth:`Monitor.peer_snapshot`), or None."""
        """The pipeline pass and microbatch its stage began last (:mod:`.chunk_watch`)."""
        # Clock anchors to turn monotonic ns into Unix seconds off the hot path.
        self.mono0_ns = time.perf_counter_ns()
        self.wall0 = time.time()
        self._acc: dict[str, int] = {}
        self._last_ns = 0
        # Nanoseconds the training thread spent blocked in collectives this step.
        self.blocked_ns = 0
        self._blocked_at = 0     # blocked_ns at the last mark
        # When the last reduction a backward issues asynchronously (DDP's gradient buckets) was
        # issued, or 0: the rest of that backward waits for the reductions (zero-code's step
        # hooks add it to blocked_ns when the backward returns).
        self.comm_ready_ns = 0

    # -- collectives ------------------------------------------------------
    def collective(self, op: int, pg: int, seq: int, t0_ns: int, t1_ns: int, nbytes: int) -> None:
        """Record one completed collective (any thread may call this)."""
        self.collectives.append((next(self._index), op, pg, seq, t0_ns, t1_ns, nbytes))

    def expert_load(self, counts: Any) -> None:
        """Tokens per local expert in the current step (the last call of a step counts)."""
        self.expert_loads.append((self.step, tuple(int(c) for c in counts)[:MAX_EXPERTS]))

    # -- steps ------------------------------------------------------------
    def begin_step(self, step: int, started_ns: int = 0, *, since_last: bool = False) -> None:
        """Open ``step`` now, or at ``started_ns`` (a ``perf_counter_ns`` reading) if given.

        ``since_last``: the step is dated from the previous step's end (zero-code opens a
        step at its first forward), so the time blocked in collectives since then (a token
        count all-gathered after the batch was fetched) is the step's, not dropped."""
        now = started_ns or time.perf_counter_ns()
        self.step = step
        self.step_started_ns = now
        self.activity = ACTIVITY_TRAIN
        self._acc = {}
        self._last_ns = now
        if not since_last:
            self.blocked_ns = 0
        self._blocked_at = 0
        self.microbatch = None

    def mark(self, phase: str) -> None:
        """Close ``phase`` now: the time since the previous mark is charged to it.

        The data phase is charged net of the time blocked in collectives within it: a rank
        that waits for a slower peer's batch in a collective before its forward (a token
        count, a barrier) waits, it does not load data.  Other phases keep their waits; the
        step's own work is its time less all of them (``blocked_ns``)."""
        now = time.perf_counter_ns()
        acc = self._acc
        span = now - self._last_ns
        blocked = self.blocked_ns
        if phase == "data":
            span -= blocked - self._blocked_at
        self._blocked_at = blocked
        acc[phase] = acc.get(phase, 0) + max(span, 0)
        self._last_ns = now

    def end_step(self, tokens: float = 0.0, flops: float = 0.0) -> None:
        now = time.perf_counter_ns()
        acc = self._acc
        self.steps.append((self.step, self.step_started_ns, now, acc.get("data", 0),
                           acc.get("forward", 0), acc.get("backward", 0),
                           acc.get("optimizer", 0), tokens, flops, self.blocked_ns))
        self.activity = ACTIVITY_IDLE
        # What blocks from here until the next step opens is the next step's when it is dated
        # from this end (``since_last``); a step opened later, at its own time, starts at 0.
        self.blocked_ns = 0
        self._blocked_at = 0

    def step_scope(self, step: int, tokens: float = 0.0, flops: float = 0.0) -> StepScope:
        return StepScope(self, step, tokens, flops)

    # -- helpers for the drainer -----------------------------------------
    def to_unix(self, t_ns: int) -> float:
        return self.wall0 + (t_ns - self.mono0_ns) * 1e-9


class StepScope:
    """``with recorder.step_scope(n):`` brackets one training step."""

    __slots__ = ("_rec", "_step", "tokens", "flops")

    def __init__(self, rec: Recorder, step: int, tokens: float, flops: float) -> None:
        self._rec, self._step, self.tokens, self.flops = rec, step, tokens, flops

    def __enter__(self) -> StepScope:
        self._rec.begin_step(self._step)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._rec.end_step(self.tokens, self.flops)
