"""OpenTelemetry export: a node's steps, checkpoints, restarts and incidents as OTLP spans,
and its GPUs' health as OTLP metrics named by the OpenTelemetry hardware conventions.

Opt-in through the standard ``OTEL_*`` variables: with no ``OTEL_{TRACES,METRICS}_EXPORTER`` and
no ``OTEL_EXPORTER_OTLP_*ENDPOINT`` set, the agent logs one line and exports nothing, and the
OpenTelemetry SDK is not even imported.  Spans carry the times the ranks measured (a step span
starts when the rank began the step), not the time the agent happened to receive them.

Steps are sampled: every Nth step of every rank, plus every step slower than k times the rank's
median (``RANKWATCH_OTEL_STEP_SAMPLE``).  The trace id of a step span is derived from the job id
(torchrun's run id) and the step number, so the spans of step N from every rank on every node,
and the incidents raised at step N, land in one trace without the agents talking to each other.

Span creation runs on the ingesting thread (~50 us per sampled step, and only sampled steps pay
it); serialisation and the network are the ``BatchSpanProcessor``'s thread, whose bounded queue
drops spans rather than ever blocking ingestion.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import math
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from rankwatch import __version__
from rankwatch.agent import recoveries

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

    from rankwatch.agent.gpu import GpuMonitor
    from rankwatch.agent.gpu.base import GpuReading
    from rankwatch.agent.incidents import Incident, IncidentLog
    from rankwatch.agent.server import Agent
    from rankwatch.agent.state import NodeState, RankState
    from rankwatch.proto import pb

__all__ = [
    "STEP_SAMPLE_ENV", "ExporterUnavailable", "OtelExport", "SpanExport", "StepSampling", "exporters",
    "gpu_instruments", "install", "step_trace_id",
]

log = logging.getLogger(__name__)

STEP_SAMPLE_ENV = "RANKWATCH_OTEL_STEP_SAMPLE"
DEFAULT_SERVICE_NAME = "rankwatch-agent"
SHUTDOWN_TIMEOUT = timedelta(seconds=5)
MIN_HISTORY = 8                 # steps of a rank's history before "slow" means anything
MAX_SPANS_PER_BATCH = 64        # step spans made from one batch; the rest are counted as skipped
MAX_ATTRIBUTE_CHARS = 32 << 10  # longer strings (hang stacks) are clipped
ERROR_KINDS = frozenset({"hang", "gpu_fault", "rank_exit"})


class ExporterUnavailable(RuntimeError):
    """The ``OTEL_*`` variables ask for an exporter whose package is not installed."""


# -- configuration --------------------------------------------------------------------------

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


# signal -> (its exporter variable, OTLP module and class, console module and class)
_SIGNALS = {
    "traces": ("OTEL_TRACES_EXPORTER", "trace_exporter", "OTLPSpanExporter",
               "opentelemetry.sdk.trace.export", "ConsoleSpanExporter"),
    "metrics": ("OTEL_METRICS_EXPORTER", "metric_exporter", "OTLPMetricExporter",
                "opentelemetry.sdk.metrics.export", "ConsoleMetricExporter"),
}


def exporters(signal: str) -> list[Any]:
    """The exporters of ``signal`` (traces, metrics) that the ``OTEL_*`` variables ask for.

    ``OTEL_TRACES_EXPORTER`` / ``OTEL_METRICS_EXPORTER`` (``otlp``, ``console``, ``none``,
    comma-separated) decide; when unset, an ``OTEL_EXPORTER_OTLP_[SIGNAL_]ENDPOINT`` means
    ``otlp``.  The OTLP protocol comes from ``OTEL_EXPORTER_OTLP_[SIGNAL_]PROTOCOL`` (``grpc``,
    the Python SDK's default, or ``http/protobuf``); the exporters read their endpoint,
    headers, timeout and TLS settings from the same variables themselves.

    Raises:
        ValueError: an unknown exporter or protocol.
        ExporterUnavailable: the exporter's package is not installed.
    """
    env = os.environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    names = env.get(_SIGNALS[signal][0], "").strip().lower()
    if not names:
        endpoint = env.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        names = "otlp" if endpoint else "none"
    return [_exporter(signal, name) for name in (n.strip() for n in names.split(",")) if name not in ("", "none")]


def _exporter(signal: str, name: str) -> Any:
    variable, otlp_module, otlp_class, console_module, console_class = _SIGNALS[signal]
    if name == "otlp":
        protocol = (os.environ.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL")
                    or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc").strip()
        name = {"grpc": "otlp_proto_grpc", "http/protobuf": "otlp_proto_http"}.get(protocol, "")
        if not name:
            raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL: {protocol!r} is not supported "
                             "(grpc or http/protobuf)")
    if name == "console":
        module, cls = console_module, console_class
    elif name in ("otlp_proto_grpc", "otlp_proto_http"):
        module, cls = f"opentelemetry.exporter.otlp.proto.{name.rsplit('_', 1)[1]}.{otlp_module}", otlp_class
    else:
        raise ValueError(f"{variable}: unknown exporter {name!r} (otlp, console or none)")
    try:
        return getattr(importlib.import_module(module), cls)()
    except ImportError as exc:
        raise ExporterUnavailable(f"the {name} exporter is not installed ({exc.name}); "
                                  "install it with: pip install 'rankwatch[otlp]'") from None


# -- wiring ---------------------------------------------------------------------------------

class OtelExport:
    """What :func:`install` set up: span export, GPU metric export, or both."""

    def __init__(self, spans: SpanExport | None, metrics: MeterProvider | None) -> None:
        self.spans, self.metrics = spans, metrics

    def shutdown(self, timeout: timedelta = SHUTDOWN_TIMEOUT) -> None:
        """Flush both, waiting at most ``timeout`` each for the collector."""
        if self.spans is not None:
            self.spans.shutdown(timeout)
        if self.metrics is not None:
            _within(self.metrics.shutdown, timeout, "the last GPU metrics")


def install(agent: Agent) -> OtelExport | None:
    """Export the agent's spans and GPU metrics as the ``OTEL_*`` variables ask.

    Never raises: when they ask for nothing, or an exporter cannot be built, this logs one
    line and the agent runs on without that signal (None: without OpenTelemetry at all).
    """
    spans = metrics = None
    problems = []
    try:
        if span_exporters := exporters("traces"):
            spans = SpanExport(_tracer_provider(agent.config.node_id, span_exporters), agent.state,
                               agent.incidents, _sampling())
    except Exception as exc:  # noqa: BLE001 - the agent runs on without spans
        problems.append(f"spans: {exc}")
    try:
        if metric_exporters := exporters("metrics"):
            metrics = _meter_provider(agent, metric_exporters)
    except Exception as exc:  # noqa: BLE001 - the agent runs on without metrics
        problems.append(f"GPU metrics: {exc}")
    if problems:
        log.warning("OpenTelemetry export off for %s", "; ".join(problems))
    elif spans is None and metrics is None:
        log.info("OpenTelemetry export off: set OTEL_EXPORTER_OTLP_ENDPOINT (or OTEL_TRACES_EXPORTER, "
                 "OTEL_METRICS_EXPORTER)")
    if spans is None and metrics is None:
        return None
    if spans is not None:
        spans.attach()
    log.info("OpenTelemetry export on: spans %s, GPU metrics %s",
             f"with step sampling {spans.sampling}" if spans else "off", "on" if metrics else "off")
    return OtelExport(spans, metrics)


def _sampling() -> StepSampling:
    try:
        return StepSampling.parse(os.environ.get(STEP_SAMPLE_ENV, ""))
    except ValueError as exc:
        log.warning("%s; using the default %s", exc, StepSampling())
        return StepSampling()


def _tracer_provider(node_id: str, chosen: list[SpanExporter]) -> TracerProvider:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    ids: Any = _TraceIds()  # duck-typed IdGenerator (see _TraceIds)
    provider = TracerProvider(resource=_resource(node_id), id_generator=ids, shutdown_on_exit=False)
    for exporter in chosen:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def _meter_provider(agent: Agent, chosen: list[Any]) -> MeterProvider:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    provider = MeterProvider(metric_readers=[PeriodicExportingMetricReader(e) for e in chosen],
                             resource=_resource(agent.config.node_id), shutdown_on_exit=False)
    gpu_instruments(provider.get_meter("rankwatch.agent", __version__), agent.gpu)
    return provider


def _within(call: Callable[[], Any], timeout: timedelta, what: str) -> None:
    """Run ``call`` (a flush) on a thread of its own; give up waiting after ``timeout``."""
    flush = threading.Thread(target=call, name="rankwatch-otel-flush", daemon=True)
    flush.start()
    flush.join(timeout.total_seconds())
    if flush.is_alive():
        log.warning("OpenTelemetry: the collector did not take %s within %s; they are lost", what, timeout)


def _resource(node_id: str) -> Any:
    """``OTEL_RESOURCE_ATTRIBUTES`` and ``OTEL_SERVICE_NAME`` first, then the agent's own facts."""
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource

    detected = Resource.create()
    ours: dict[str, Any] = {"host.name": socket.gethostname(), "service.version": __version__}
    ours = {k: v for k, v in ours.items() if k not in detected.attributes}
    ours["rankwatch.node"] = node_id
    if str(detected.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        ours[SERVICE_NAME] = DEFAULT_SERVICE_NAME
    return detected.merge(Resource(ours))


class _TraceIds:
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
        provider: owns the exporters; its id generator must be a :class:`_TraceIds`.
        state: the node's ranks (step listeners are added here).
        incidents: the agent's incident log (incident listeners are added here).
        sampling: which steps become spans.
    """

    def __init__(self, provider: TracerProvider, state: NodeState, incidents: IncidentLog,
                 sampling: StepSampling) -> None:
        self.provider, self.state, self.incidents, self.sampling = provider, state, incidents, sampling
        self._tracer = provider.get_tracer("rankwatch.agent", __version__)
        self._ids: _TraceIds = provider.id_generator  # type: ignore[assignment]
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
        _within(self.provider.shutdown, timeout, "the last spans")
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

def gpu_instruments(meter: Any, gpu: GpuMonitor) -> None:
    """Observable instruments over the GPU monitor's latest readings.

    Named by the OpenTelemetry hardware semantic conventions (``hw.*``), with ``hw.type="gpu"``,
    ``hw.id`` the GPU's UUID and ``rankwatch.gpu`` its index.  Readings the conventions have no
    name for (clocks, throttle reasons, power limit, remapped rows) stay Prometheus-only.
    """
    from opentelemetry.metrics import Observation

    def observe(values: Callable[[GpuReading], list[tuple[float, dict[str, str]]]]) -> Callable:
        def callback(_options: Any) -> list[Observation]:
            return [Observation(value, {**_gpu_attributes(r), **extra})
                    for r in gpu.readings() for value, extra in values(r)]
        return callback

    def field(name: str, extra: dict[str, str] | None = None) -> Callable:
        def values(r: GpuReading) -> list[tuple[float, dict[str, str]]]:
            value = getattr(r, name)
            return [(value, extra or {})] if r.up and value is not None else []
        return observe(values)

    meter.create_observable_gauge("hw.gpu.utilization", [field("utilization_ratio", {"hw.gpu.task": "general"})],
                                  unit="1", description="Fraction of time the GPU was busy")
    meter.create_observable_gauge("hw.gpu.memory.utilization", [field("memory_utilization_ratio")], unit="1",
                                  description="Fraction of time the GPU memory was read or written")
    meter.create_observable_up_down_counter("hw.gpu.memory.usage", [field("memory_used_bytes")], unit="By",
                                            description="GPU memory used")
    meter.create_observable_up_down_counter("hw.gpu.memory.limit", [field("memory_total_bytes")], unit="By",
                                            description="Size of the GPU memory")
    meter.create_observable_gauge("hw.temperature", [field("temperature_celsius")], unit="Cel",
                                  description="GPU temperature")
    meter.create_observable_gauge("hw.power", [field("power_watts")], unit="W", description="GPU power draw")
    meter.create_observable_up_down_counter(
        "hw.status", [observe(lambda r: [(int(r.up), {"hw.state": "ok"}), (int(not r.up), {"hw.state": "failed"})])],
        unit="1", description="1 for the GPU's state: ok while it answers, failed once it is lost")
    meter.create_observable_counter(
        "hw.errors", [observe(lambda r: _gpu_errors(r, gpu.xid_counts()))], unit="{error}",
        description="GPU errors by error.type: ecc_corrected, ecc_uncorrected, pcie_replay, "
                    "nvlink_<type>, xid_<n>")


def _gpu_attributes(r: GpuReading) -> dict[str, str]:
    return {"hw.type": "gpu", "hw.id": r.uuid, "hw.name": r.name, "rankwatch.gpu": str(r.index)}


def _gpu_errors(r: GpuReading, xids: dict[tuple[int, int], int]) -> list[tuple[float, dict[str, str]]]:
    """A GPU's running error totals by ``error.type``."""
    from rankwatch.agent.gpu.base import ECC_SEVERITIES

    totals: dict[str, int] = {}
    for severity in ECC_SEVERITIES:
        if (count := r.ecc_count(severity)) is not None:
            totals[f"ecc_{severity}"] = count
    if r.pcie_replays is not None:
        totals["pcie_replay"] = r.pcie_replays
    for (_, kind), count in r.nvlink_errors.items():
        totals[f"nvlink_{kind}"] = totals.get(f"nvlink_{kind}", 0) + count
    for (index, xid), count in xids.items():
        if index == r.index:
            totals[f"xid_{xid}"] = count
    return [(count, {"error.type": kind}) for kind, count in totals.items()]
