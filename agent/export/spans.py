"""OpenTelemetry spans: a node's sampled steps and its incidents (checkpoints, restarts,
hangs) as OTLP spans, each step's trace id derived from the job and the step (see
:mod:`.otel`, which configures the export and owns the GPU metrics).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from rankwatch import __version__
from rankwatch.agent.node import recoveries

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

    from rankwatch.agent.durable.incidents import Incident, IncidentLog
    from rankwatch.agent.node.intake import NodeState, RankState
    from rankwatch.proto import pb

__all__ = ["SHUTDOWN_TIMEOUT", "STEP_SAMPLE_ENV", "SpanExport", "StepSampling", "TraceIds", "flush_within", "rank_attributes", "step_trace_id"]

log = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT = timedelta(seconds=5)
MIN_HISTORY = 8                 # steps of a rank's history before "slow" means anything
MAX_SPANS_PER_BATCH = 64        # step spans made from one batch; the rest are counted as skipped
MAX_ATTRIBUTE_CHARS = 32 << 10  # longer strings (hang stacks) are clipped
ERROR_KINDS = frozenset({"hang", "gpu_fault", "rank_exit"})


def flush_within(call: Callable[[], Any], timeout: timedelta, what: str) -> None:
    """Run ``call`` (a flush) on a thread of its own; give up waiting after ``timeout``."""
    flush = threading.Thread(target=call, name="rankwatch-otel-flush", daemon=True)
    flush.start()
    flush.join(timeout.total_seconds())
    if flush.is_alive():
        log.warning("OpenTelemetry: the collector did not take %s within %s; they are lost", what, timeout)


STEP_SAMPLE_ENV = "RANKWATCH_OTEL_STEP_SAMPLE"


@dataclass(frozen=True, kw_only=True)
class StepSampling:
    """Which completed steps become spans: ``every=N,slower=K`` in ``RANKWATCH_OTEL_STEP_SAMPLE``."""

    every: int = 100
    """Every step whose number is a multiple of this, on every rank (0: none)."""
    slower: float = 2.0
    """Every step longer than this many times the rank's median step time (0: none)."""

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"{STEP_SAMPLE_ENV}: every={self.every} must be >= 0")
        if not (self.slower == 0 or (math.isfinite(self.slower) and self.slower >= 1)):
            raise ValueError(f"{STEP_SAMPLE_ENV}: slower={self.slower} must be 0 or >= 1")

    @classmethod
    def parse(cls, text: str) -> StepSampling:
        """``"every=100,slower=2"``; either key may be left out (its default holds).

        Raises:
            ValueError: an unknown key or a bad number, naming the variable.
        """
        fields: dict[str, Any] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, _, value = item.partition("=")
            try:
                fields[key.strip()] = {"every": int, "slower": float}[key.strip()](value)
            except KeyError:
                raise ValueError(f"{STEP_SAMPLE_ENV}: unknown key {key!r} (every, slower)") from None
            except ValueError:
                raise ValueError(f"{STEP_SAMPLE_ENV}: {item!r} is not a number") from None
        return cls(**fields)

    def pick(self, steps: Sequence[int], durations: Sequence[float], median: float) -> list[tuple[int, bool]]:
        """``(index, slow)`` of each sampled step of one batch.

        Plain Python, not numpy: a batch holds a handful of steps, where numpy's per-call
        overhead would be most of the cost.

        Args:
            steps: step numbers.
            durations: wall seconds of those steps.
            median: the rank's median step time; 0 when there is too little history.
        """
        every = self.every
        limit = self.slower * median if self.slower and median > 0 else math.inf
        return [(i, d > limit) for i, (n, d) in enumerate(zip(steps, durations))
                if d > limit or (every and n % every == 0)]


class TraceIds:
    """Random ids, except that a caller may name the next root span's trace id.

    Duck-typed to the SDK's ``IdGenerator`` so that importing this module needs no SDK.
    """

    def __init__(self) -> None:
        self._asked = threading.local()

    def ask(self, trace_id: int) -> None:
        """The next root span started on this thread gets ``trace_id`` (0: a random one)."""
        self._asked.trace_id = trace_id

    def generate_trace_id(self) -> int:
        trace_id, self._asked.trace_id = getattr(self._asked, "trace_id", 0), 0
        while not trace_id:
            trace_id = random.getrandbits(128)
        return trace_id

    def generate_span_id(self) -> int:
        span_id = 0
        while not span_id:
            span_id = random.getrandbits(64)
        return span_id

    def is_trace_id_random(self) -> bool:
        return False  # step traces' ids are derived from the job and step, not drawn


def step_trace_id(job_id: str, step: int) -> int:
    """The trace of step ``step`` of job ``job_id``, the same on every node (0 without a job id)."""
    if not job_id or step < 0:
        return 0
    return int.from_bytes(hashlib.blake2b(f"{job_id}\0{step}".encode(), digest_size=16).digest(), "big")


# -- spans ----------------------------------------------------------------------------------

class SpanExport:
    """Turns the node's completed steps and its incidents into spans.

    Args:
        provider: owns the exporters; its id generator must be a :class:`TraceIds`.
        state: the node's ranks (step listeners are added here).
        incidents: the agent's incident log (incident listeners are added here).
        sampling: which steps become spans.
    """

    def __init__(self, provider: TracerProvider, state: NodeState, incidents: IncidentLog,
                 sampling: StepSampling) -> None:
        self.provider, self.state, self.incidents, self.sampling = provider, state, incidents, sampling
        self._tracer = provider.get_tracer("rankwatch.agent", __version__)
        self._ids: TraceIds = provider.id_generator  # type: ignore[assignment]
        self._closed = False
        self.skipped_steps = 0
        self._failures_logged_at = 0.0

    def attach(self) -> None:
        self.state.step_listeners.append(self.on_steps)
        self.incidents.listeners.append(self.on_incident)

    def shutdown(self, timeout: timedelta = SHUTDOWN_TIMEOUT) -> None:
        """Stop listening and flush what is queued, waiting at most ``timeout`` for the collector."""
        if self._closed:
            return
        self._closed = True
        if self.on_steps in self.state.step_listeners:
            self.state.step_listeners.remove(self.on_steps)
        if self.on_incident in self.incidents.listeners:
            self.incidents.listeners.remove(self.on_incident)
        flush_within(self.provider.shutdown, timeout, "the last spans")
        if self.skipped_steps:
            log.info("OpenTelemetry: %d sampled steps were over %d per batch and made no span",
                     self.skipped_steps, MAX_SPANS_PER_BATCH)

    # -- steps ----------------------------------------------------------------------------
    def on_steps(self, rank: RankState, steps: pb.StepColumns) -> None:
        """Step listener: span the sampled steps of one validated batch."""
        if self._closed:
            return
        try:
            history = sorted(rank.step_durations)
            median = history[len(history) // 2] if len(history) >= MIN_HISTORY else 0.0
            picked = self.sampling.pick(steps.step, steps.duration, median)
            if not picked:
                return
            if len(picked) > MAX_SPANS_PER_BATCH:
                self.skipped_steps += len(picked) - MAX_SPANS_PER_BATCH
            base = rank_attributes(rank)
            for i, slow in picked[:MAX_SPANS_PER_BATCH]:
                self._step_span(base, rank.job_id, steps, i, median, slow)
        except Exception:  # noqa: BLE001 - ingestion never fails because of export
            self._log_failure("step spans")

    def _step_span(self, base: dict[str, Any], job_id: str, s: pb.StepColumns, i: int,
                   median: float, slow: bool) -> None:
        step, duration = int(s.step[i]), s.duration[i]
        attrs = {**base, "rankwatch.step": step, "rankwatch.step.sampled": "slow" if slow else "periodic",
                 "rankwatch.step.data_seconds": s.data[i], "rankwatch.step.forward_seconds": s.forward[i],
                 "rankwatch.step.backward_seconds": s.backward[i],
                 "rankwatch.step.optimizer_seconds": s.optimizer[i],
                 "rankwatch.step.tokens": s.tokens[i], "rankwatch.step.flops": s.flops[i]}
        if s.wait:
            attrs["rankwatch.step.collective_wait_seconds"] = s.wait[i]
        if median > 0:
            attrs["rankwatch.step.slowdown"] = duration / median
        start = _ns(s.start[i])
        self._ids.ask(step_trace_id(job_id, step))
        self._tracer.start_span("rankwatch.step", start_time=start, attributes=attrs).end(
            end_time=start + _ns(duration))

    # -- incidents --------------------------------------------------------------------------
    def on_incident(self, incident: Incident) -> None:
        """Incident listener: one span per incident, from ``detail.started_at`` if given."""
        if self._closed:
            return
        try:
            self._incident_span(incident)
        except Exception:  # noqa: BLE001 - the detectors never fail because of export
            self._log_failure("an incident span")

    def _incident_span(self, incident: Incident) -> None:
        from opentelemetry.trace import Status, StatusCode

        kind, detail = incident.kind, _clip(dict(incident.detail))
        end = float(incident.detected_at)
        started = detail.get("started_at")
        start = float(started) if _is_number(started) and 0 < started <= end else end
        if recoveries.is_in_process(incident):   # caught at detected_at, over at its first step
            start, end = recoveries.span(incident)
        rank, step = incident.rank, incident.step
        local = self.state.ranks.get(rank) if incident.node == self.state.node_id else None
        attrs = {**(rank_attributes(local) if local is not None else {}),
                 "rankwatch.node": incident.node, "rankwatch.rank": rank,
                 "rankwatch.step": step, "rankwatch.incident.id": incident.id,
                 "rankwatch.incident.kind": kind,
                 "rankwatch.incident.detail": json.dumps(detail, default=str),
                 **dict(_flatten(detail, "rankwatch.incident.detail"))}
        self._ids.ask(step_trace_id(local.job_id, step) if local is not None else 0)
        span = self._tracer.start_span(f"rankwatch.{kind}", start_time=_ns(start), attributes=attrs)
        if kind in ERROR_KINDS:
            span.set_status(Status(StatusCode.ERROR, str(detail.get("reason") or kind)))
        span.end(end_time=_ns(end))

    def _log_failure(self, what: str) -> None:
        now = time.monotonic()
        if now - self._failures_logged_at >= 60:
            self._failures_logged_at = now
            log.exception("OpenTelemetry: could not make %s (logged once a minute)", what)


def rank_attributes(rank: RankState) -> dict[str, Any]:
    """A rank's identity and mesh coordinates as span attributes."""
    attrs: dict[str, Any] = {"rankwatch.node": rank.node, "rankwatch.rank": rank.rank,
                             "rankwatch.local_rank": rank.local_rank,
                             "rankwatch.world_size": rank.world_size, "process.pid": rank.pid}
    if rank.job_id:
        attrs["rankwatch.job_id"] = rank.job_id
    for dim, coord in rank.mesh_coords.items():
        attrs[f"rankwatch.mesh.{dim}"] = coord
    return attrs


def _ns(seconds: float) -> int:
    return int(round(seconds * 1e9))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _clip(value: Any) -> Any:
    """``value`` with every string longer than MAX_ATTRIBUTE_CHARS cut to that length."""
    if isinstance(value, str) and len(value) > MAX_ATTRIBUTE_CHARS:
        return value[:MAX_ATTRIBUTE_CHARS] + f"... [{len(value) - MAX_ATTRIBUTE_CHARS} more characters]"
    if isinstance(value, dict):
        return {str(k): _clip(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clip(v) for v in value]
    return value


def _flatten(detail: dict[str, Any], prefix: str) -> Iterator[tuple[str, Any]]:
    """The scalar leaves of ``detail`` under dotted keys; lists and nulls stay in the JSON only."""
    for key, value in detail.items():
        name = f"{prefix}.{key}"
        if isinstance(value, dict):
            yield from _flatten(value, name)
        elif isinstance(value, (bool, str, float)) or (isinstance(value, int) and -(1 << 63) <= value < 1 << 63):
            yield name, value


# -- GPU metrics ------------------------------------------------------------------------------
