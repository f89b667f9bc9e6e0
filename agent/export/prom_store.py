"""The agent's durable files in /metrics: writes that failed, what waits, what was lost.

Reads :func:`~rankwatch.agent.durable.storage.storage_report`, the same report
``status --json``'s ``storage`` shows.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from rankwatch.agent.durable.storage import storage_report

if TYPE_CHECKING:
    from rankwatch.agent.durable.incidents import IncidentLog
    from rankwatch.agent.durable.decisions import DecisionLog

__all__ = ["StorageCollector"]


class StorageCollector:
    """The ``rankwatch_state_*`` series and ``rankwatch_incidents_evicted`` of one node's logs."""

    def __init__(self, node_id: str, incidents: IncidentLog, decisions: DecisionLog) -> None:
        self._node = node_id
        self._incidents = incidents
        self._decisions = decisions

    def collect(self) -> Iterable[Metric]:
        node = self._node
        ok = GaugeMetricFamily("rankwatch_state_writable", "1 while the agent's last write of the file "
                               "succeeded.", labels=["node", "file"])
        spooled = GaugeMetricFamily("rankwatch_state_spooled_records", "Records waiting in memory for "
                                    "a file that cannot be written now (retried every second).",
                                    labels=["node", "file"])
        failures = CounterMetricFamily("rankwatch_state_write_failures", "Failed attempts to write a "
                                       "file of the agent's state directory.", labels=["node", "file"])
        dropped = CounterMetricFamily("rankwatch_state_records_dropped", "Records never written: the "
                                      "spool was full (spool_full) or the run's bound was reached "
                                      "(run_bound).", labels=["node", "file", "reason"])
        for name, h in storage_report(self._incidents, self._decisions).items():
            ok.add_metric([node, name], 1.0 if h.ok else 0.0)
            spooled.add_metric([node, name], h.spooled)
            failures.add_metric([node, name], h.failures)
            dropped.add_metric([node, name, "spool_full"], h.spool_dropped)
            dropped.add_metric([node, name, "run_bound"], h.bound_dropped)
        evicted = CounterMetricFamily("rankwatch_incidents_evicted", "Incidents let go from the agent's "
                                      "memory by its bounds (the file keeps them).", labels=["node"])
        evicted.add_metric([node], getattr(self._incidents, "dropped", 0))
        yield from (ok, spooled, failures, dropped, evicted)
