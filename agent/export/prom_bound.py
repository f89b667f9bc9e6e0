"""What bounds the steps in /metrics: each kind's share of the step and the kind named now.

Fixed labels: ``node`` (the agent), ``scope`` (``node``: this node's ranks, on every agent;
``job``: the job's, on the coordinator only) and ``kind`` (input, communication, compute).
A scope's series are absent until it has enough steps (``bottleneck`` null in ``status``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client.core import GaugeMetricFamily, Metric

from rankwatch.agent.detect.bottleneck import KINDS, Verdict

__all__ = ["BoundCollector"]


class BoundCollector:
    """Args:
        node_id: this agent's node.
        verdicts: ``(scope, verdict or None)`` for each scope this agent names now.
    """

    def __init__(self, node_id: str, verdicts: Callable[[], list[tuple[str, Verdict | None]]]) -> None:
        self._node = node_id
        self._verdicts = verdicts

    def collect(self) -> Iterable[Metric]:
        share = GaugeMetricFamily("rankwatch_bottleneck_share",
                                  "Each kind's share of the step (0 to 1): input (data wait), communication "
                                  "(collective wait of the ranks that work the most), compute (the rest).",
                                  labels=["node", "scope", "kind"])
        named = GaugeMetricFamily("rankwatch_bottleneck",
                                  "1 for the kind that bounds the steps now (the largest share, with "
                                  "hysteresis), 0 for the others.", labels=["node", "scope", "kind"])
        for scope, v in self._verdicts():
            if v is None:
                continue
            for kind in KINDS:
                share.add_metric([self._node, scope, kind], v.shares[kind])
                named.add_metric([self._node, scope, kind], 1.0 if kind == v.kind else 0.0)
        yield share
        yield named
