"""Prometheus export of the node's rank exits: ``rankwatch_rank_exits_total{node, how}``.

One series per way a worker can end (``how``: exception, signal, oom, exit_code, the fixed
set of :data:`rankwatch.agent.node.exit_cause.HOWS`), each present from the start at 0, so a
rate or an alert needs no ``absent()``.  What ``how`` is, is decided in
``agent/node/exit_cause.py``; the counts are the node watch's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from prometheus_client.core import CounterMetricFamily, Metric

from rankwatch.agent.node.exit_cause import HOWS

__all__ = ["ExitCollector"]


class ExitCollector:
    """Args:
        node: this node's id.
        counts: rank exits recorded so far, by how they ended.
    """

    def __init__(self, node: str, counts: Callable[[], Mapping[str, int]]) -> None:
        self._node = node
        self._counts = counts

    def collect(self) -> Iterable[Metric]:
        counts = self._counts()
        c = CounterMetricFamily("rankwatch_rank_exits", "Workers of this node that ended other than "
                                "cleanly, by how (exception, signal, oom, exit_code).", labels=["node", "how"])
        for how in HOWS:
            c.add_metric([self._node, how], counts.get(how, 0))
        yield c
