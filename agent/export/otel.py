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

import importlib
import logging
import os
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from rankwatch import __version__
from rankwatch.agent.export.spans import (
    SHUTDOWN_TIMEOUT, STEP_SAMPLE_ENV, SpanExport, StepSampling, TraceIds, flush_within, step_trace_id,
)

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

    from rankwatch.agent.gpu import GpuMonitor
    from rankwatch.agent.gpu.base import GpuReading
    from rankwatch.agent.durable.incidents import IncidentLog
    from rankwatch.agent.node.intake import NodeState

__all__ = [
    "STEP_SAMPLE_ENV", "ExporterUnavailable", "OtelExport", "SpanExport", "StepSampling", "exporters",
    "gpu_instruments", "install", "step_trace_id",
]

log = logging.getLogger(__name__)

DEFAULT_SERVICE_NAME = "rankwatch-agent"


class ExporterUnavailable(RuntimeError):
    """The ``OTEL_*`` variables ask for an exporter whose package is not installed."""


# -- configuration --------------------------------------------------------------------------

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
            flush_within(self.metrics.shutdown, timeout, "the last GPU metrics")


def install(node_id: str, state: NodeState, incidents: IncidentLog,
            gpu: GpuMonitor | None) -> OtelExport | None:
    """Export the node's spans (its ranks' steps, its incidents) and GPU metrics as the
    ``OTEL_*`` variables ask.

    Never raises: when they ask for nothing, or an exporter cannot be built, this logs one
    line and the agent runs on without that signal (None: without OpenTelemetry at all).
    """
    spans = metrics = None
    problems = []
    try:
        if span_exporters := exporters("traces"):
            spans = SpanExport(_tracer_provider(node_id, span_exporters), state, incidents, _sampling())
    except Exception as exc:  # noqa: BLE001 - the agent runs on without spans
        problems.append(f"spans: {exc}")
    try:
        if metric_exporters := exporters("metrics"):
            metrics = _meter_provider(node_id, gpu, metric_exporters)
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

    ids: Any = TraceIds()  # duck-typed IdGenerator (see TraceIds)
    provider = TracerProvider(resource=_resource(node_id), id_generator=ids, shutdown_on_exit=False)
    for exporter in chosen:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def _meter_provider(node_id: str, gpu: GpuMonitor | None, chosen: list[Any]) -> MeterProvider:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    provider = MeterProvider(metric_readers=[PeriodicExportingMetricReader(e) for e in chosen],
                             resource=_resource(node_id), shutdown_on_exit=False)
    if gpu is not None:
        gpu_instruments(provider.get_meter("rankwatch.agent", __version__), gpu)
    return provider


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
