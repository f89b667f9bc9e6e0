"""Imbalance by design in /metrics: the pipeline stages' compute and bubbles, the experts' skew.

Fixed labels: ``node`` (the agent), ``scope`` (``node``: this node's ranks, on every agent;
``job``: the job's, on the coordinator only) and ``stage`` (a pipeline stage).  Per-stage
series, never per rank; a scope's series are absent until it has a finding
(:mod:`rankwatch.agent.detect.imbalance`; ``pipeline`` and ``experts`` null in ``status``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from prometheus_client.core import GaugeMetricFamily, Metric

from rankwatch.agent.views.work_spread import Findings

__all__ = ["BalanceCollector"]


class BalanceCollector:
    """Args:
        node_id: this agent's node.
        findings: ``(scope, pipeline or None, expert skew or None)`` for each scope it names now.
    """

    def __init__(self, node_id: str, findings: Callable[[], Iterable[Findings]]) -> None:
        self._node = node_id
        self._findings = findings

    def collect(self) -> Iterable[Metric]:
        lbl = ["node", "scope"]
        compute = GaugeMetricFamily("rankwatch_pipeline_stage_compute_seconds",
                                    "A pipeline stage's median own work per step (its ranks' median).",
                                    labels=lbl + ["stage"])
        bubble = GaugeMetricFamily("rankwatch_pipeline_stage_bubble_ratio",
                                   "The share of a pipeline stage's step it waits on the other stages (0 to 1).",
                                   labels=lbl + ["stage"])
        imbalance = GaugeMetricFamily("rankwatch_pipeline_stage_imbalance_ratio",
                                      "The heaviest pipeline stage's compute over the lightest's (1 = even).",
                                      labels=lbl)
        idle = GaugeMetricFamily("rankwatch_pipeline_idle_ratio",
                                 "The pipeline's idle share of a step: its stages' mean bubble (0 to 1).", labels=lbl)
        skew = GaugeMetricFamily("rankwatch_expert_load_skew_ratio",
                                 "The tokens per step of the rank whose experts get the most, over the ranks' "
                                 "mean (1 = even).", labels=lbl)
        for scope, pipe, experts in self._findings():
            key = [self._node, scope]
            if pipe is not None:
                for s in pipe.stages:
                    compute.add_metric(key + [str(s.stage)], s.compute)
                    bubble.add_metric(key + [str(s.stage)], s.bubble)
                if math.isfinite(pipe.imbalance):
                    imbalance.add_metric(key, pipe.imbalance)
                idle.add_metric(key, pipe.idle)
            if experts is not None:
                skew.add_metric(key, experts.skew)
        yield from (compute, bubble, imbalance, idle, skew)
