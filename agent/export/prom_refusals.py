"""The agent's front door in /metrics: calls refused by reason, streams open and their cap."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from rankwatch.agent.rpc.gate import Gate

__all__ = ["GateCollector"]


class GateCollector:
    """The ``rankwatch_rpcs_refused`` and ``rankwatch_streams_*`` series of one agent's gate."""

    def __init__(self, node_id: str, gate: Gate) -> None:
        self._node = node_id
        self._gate = gate

    def collect(self) -> Iterable[Metric]:
        node = self._node
        c = CounterMetricFamily("rankwatch_rpcs_refused", "Calls the agent refused at its door, by reason "
                                "(unauthenticated, streams_total, streams_per_peer, evicted, not_this_node, no_hello, waiting, "
                                "no_request, expired)",
                                labels=["node", "reason"])
        for reason, n in sorted(self._gate.refusals().items()):
            c.add_metric([node, reason], n)
        yield c
        g = GaugeMetricFamily("rankwatch_streams_open", "Report and Commands streams being served",
                              labels=["node"])
        g.add_metric([node], self._gate.open_streams())
        yield g
        cap = GaugeMetricFamily("rankwatch_streams_limit", "Streams served at once, at most", labels=["node"])
        cap.add_metric([node], self._gate.limits.total)
        yield cap
