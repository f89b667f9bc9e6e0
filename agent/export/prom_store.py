"""The agent's durable files in /metrics and ``status``: writes that failed, what waits.

An incident or decision that could not be written (a full disk, an unwritable or
hijacked path) waits in its writer's spool (:class:`rankwatch.agent.durable.jsonl.Writer`) and is
retried; these series and ``status --json``'s ``storage`` make that visible.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from rankwatch.proto import pb

__all__ = ["StorageCollector", "fill_status", "storage"]


def storage(agent: Any) -> dict[str, Any]:
    """``{file name: (writer, records the run's bound kept out)}`` of an agent's logs with a file."""
    out = {}
    for name, log in (("incidents", agent.incidents), ("decisions", agent.decision_log)):
        if getattr(log, "writer", None) is not None:
            out[name] = (log.writer, getattr(log, "file_dropped", 0))
    return out


def fill_status(resp: pb.StatusResponse, agent: Any) -> None:
    for name, (w, bound) in storage(agent).items():
        resp.storage[name].CopyFrom(pb.StorageStatus(
            path=str(w.path), ok=not w.last_error, written=w.written, spooled=w.spooled,
            failures=w.failures, dropped=w.dropped + bound, last_error=w.last_error))


class StorageCollector:
    def __init__(self, agent: Any) -> None:
        self._agent = agent

    def collect(self) -> Iterable[Metric]:
        node = self._agent.config.node_id
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
        for name, (w, bound) in storage(self._agent).items():
            ok.add_metric([node, name], 0.0 if w.last_error else 1.0)
            spooled.add_metric([node, name], w.spooled)
            failures.add_metric([node, name], w.failures)
            dropped.add_metric([node, name, "spool_full"], w.dropped)
            dropped.add_metric([node, name, "run_bound"], bound)
        evicted = CounterMetricFamily("rankwatch_incidents_evicted", "Incidents let go from the agent's "
                                      "memory by its bounds (the file keeps them).", labels=["node"])
        evicted.add_metric([node], getattr(self._agent.incidents, "dropped", 0))
        yield from (ok, spooled, failures, dropped, evicted)
