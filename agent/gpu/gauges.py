"""Prometheus export of the GPU monitor: the ``rankwatch_gpu_*`` series.

Labels ``node`` and ``gpu`` (the index, as a string) on every series.  A field
the source cannot read has no series; a lost GPU keeps only its info, ``up``
(0) and XID counts.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric

from rankwatch.agent.gpu.base import RECOVERY_ACTIONS, THROTTLE_REASONS, GpuReading
from rankwatch.agent.gpu.monitor import GpuMonitor
from rankwatch.agent.gpu.xid import action_for

__all__ = ["GpuCollector"]

_GAUGES = (  # GpuReading field, metric, help
    ("temperature_celsius", "rankwatch_gpu_temperature_celsius", "GPU core temperature."),
    ("power_watts", "rankwatch_gpu_power_watts", "GPU power draw."),
    ("power_limit_watts", "rankwatch_gpu_power_limit_watts", "Enforced GPU power limit."),
    ("sm_clock_hertz", "rankwatch_gpu_sm_clock_hertz", "Current SM clock."),
    ("memory_clock_hertz", "rankwatch_gpu_memory_clock_hertz", "Current memory clock."),
    ("utilization_ratio", "rankwatch_gpu_utilization_ratio",
     "Share of the last sample period a kernel ran on the GPU (0-1)."),
    ("memory_utilization_ratio", "rankwatch_gpu_memory_utilization_ratio",
     "Share of the last sample period device memory was read or written (0-1)."),
    ("memory_used_bytes", "rankwatch_gpu_memory_used_bytes", "Device memory in use."),
    ("memory_total_bytes", "rankwatch_gpu_memory_total_bytes", "Device memory."),
)
_LABELS = ["node", "gpu"]


class GpuCollector:
    """``collect()`` renders the monitor's latest readings."""

    def __init__(self, monitor: GpuMonitor) -> None:
        self._monitor = monitor

    def collect(self) -> Iterable[Metric]:
        node, source = self._monitor.node, self._monitor.source_name
        if source is None:
            return
        readings = self._monitor.readings()
        info = InfoMetricFamily("rankwatch_gpu", "A GPU of this node and where its readings come from.",
                                labels=_LABELS)
        up = GaugeMetricFamily("rankwatch_gpu_up", "1 while the GPU answers, 0 once it is lost.", labels=_LABELS)
        for r in readings:
            info.add_metric([node, str(r.index)], {"uuid": r.uuid, "name": r.name, "source": source})
            up.add_metric([node, str(r.index)], 1.0 if r.up else 0.0)
        yield info
        yield up
        live = [r for r in readings if r.up]
        yield from _gauges(node, live)
        yield from _health(node, live)
        yield _xids(node, self._monitor.xid_counts())


def _gauges(node: str, readings: list[GpuReading]) -> Iterable[Metric]:
    for field, name, doc in _GAUGES:
        g = GaugeMetricFamily(name, doc, labels=_LABELS)
        for r in readings:
            value = getattr(r, field)
            if value is not None:
                g.add_metric([node, str(r.index)], float(value))
        yield g
    g = GaugeMetricFamily("rankwatch_gpu_throttle", "1 while a clock event (throttle) reason is active.",
                          labels=_LABELS + ["reason"])
    for r in readings:
        if r.throttle is not None:
            for reason in THROTTLE_REASONS:
                g.add_metric([node, str(r.index), reason], 1.0 if reason in r.throttle else 0.0)
    yield g


def _health(node: str, readings: list[GpuReading]) -> Iterable[Metric]:
    ecc = CounterMetricFamily("rankwatch_gpu_ecc_errors", "ECC errors: volatile since the last driver "
                              "load or GPU reset, aggregate over the GPU's life.",
                              labels=_LABELS + ["severity", "counter"])
    remap = GaugeMetricFamily("rankwatch_gpu_remapped_rows", "Rows remapped for correctable and "
                              "uncorrectable errors; pending and failed are 0/1 flags.",
                              labels=_LABELS + ["state"])
    pcie = CounterMetricFamily("rankwatch_gpu_pcie_replays", "PCIe replays.", labels=_LABELS)
    nvlink = CounterMetricFamily("rankwatch_gpu_nvlink_errors", "NVLink errors per link.",
                                 labels=_LABELS + ["link", "type"])
    recovery = GaugeMetricFamily("rankwatch_gpu_recovery_action", "1 for the recovery action the driver "
                                 "asks for now (none while healthy); no series if the driver cannot tell.",
                                 labels=_LABELS + ["action"])
    for r in readings:
        gpu = str(r.index)
        for (severity, counter), n in sorted(r.ecc.items()):
            ecc.add_metric([node, gpu, severity, counter], float(n))
        for state, n in sorted(r.remapped_rows.items()):
            remap.add_metric([node, gpu, state], float(n))
        if r.pcie_replays is not None:
            pcie.add_metric([node, gpu], float(r.pcie_replays))
        for (link, kind), n in sorted(r.nvlink_errors.items()):
            nvlink.add_metric([node, gpu, link, kind], float(n))
        if r.recovery_action is not None:
            for action in sorted({*RECOVERY_ACTIONS, r.recovery_action}):
                recovery.add_metric([node, gpu, action], 1.0 if action == r.recovery_action else 0.0)
    yield from (ecc, remap, pcie, nvlink, recovery)


def _xids(node: str, counts: dict[tuple[int, int], int]) -> Metric:
    c = CounterMetricFamily("rankwatch_gpu_xid_errors", "XID events seen since the agent started, "
                            "with the catalogue's immediate action.", labels=_LABELS + ["xid", "action"])
    for (gpu, xid), n in sorted(counts.items()):
        c.add_metric([node, str(gpu), str(xid), action_for(xid)], float(n))
    return c
