"""Prometheus export of the job side: goodput, restarts (torchrun's and in-process), exclusions,
checkpoints, coordinator.

On the coordinator these are the job's figures; on a node agent, what it
has seen of the job through its coordinator.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from rankwatch.agent.job.goodput import KINDS

if TYPE_CHECKING:
    from rankwatch.agent.durable.incidents import Incident
    from rankwatch.agent.link.known import JobShown
    from rankwatch.agent.durable.decisions import Decision
    from rankwatch.agent.link.known import JobKnowledge
    from rankwatch.agent.relays.relay import Relay
    from rankwatch.agent.node.recoveries import RecoveryLog

__all__ = ["JobCollector"]

_SAVE_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_RESTART_REASONS = ("node_dead", "hang", "gpu_fault", "straggler", "operator")


def restart_reason(text: str) -> str:
    """The ``reason`` label of a restart decision, from its logged reason."""
    for prefix, label in (("node dead", "node_dead"), ("hang", "hang"), ("fatal GPU", "gpu_fault"),
                          ("straggler", "straggler")):
        if text.startswith(prefix):
            return label
    return "operator"


class JobCollector:
    """The job's series, as this agent knows the job.

    Args:
        node_id: this agent's node (the ``node`` label of every series).
        clock: the agent's clock (Unix seconds).
        job: what this agent knows of the job.
        recoveries: the in-process recoveries this node's ranks reported.
    """

    def __init__(self, node_id: str, clock: Callable[[], float], job: JobKnowledge,
                 recoveries: RecoveryLog) -> None:
        self._node = node_id
        self._clock = clock
        self._job = job
        self._recoveries = recoveries

    def collect(self) -> Iterable[Metric]:
        node, job = self._node, self._job
        decisions = job.decisions()
        yield from _goodput(node, job.goodput(self._clock()))
        yield from _restarts(node, decisions)
        c = CounterMetricFamily("rankwatch_in_process_recoveries",
                                "In-process recoveries this node's ranks went through, by outcome "
                                "(ok, failed): one per recovery, however many of its ranks reported it.",
                                labels=["node", "outcome"])
        for outcome, n in self._recoveries.counts.items():
            c.add_metric([node, outcome], n)
        yield c
        yield from _checkpoints(node, decisions, job.incidents())
        yield from _coordination(node, job.view(), job.relay())


def _goodput(node: str, breakdown: dict[str, float] | None) -> Iterable[Metric]:
    lbl = [node]
    if breakdown is not None:
        g = GaugeMetricFamily("rankwatch_goodput_ratio",
                              "Productive time over elapsed time since the job's first step.",
                              labels=["node"])
        g.add_metric(lbl, breakdown["productive"] / breakdown["elapsed"])
        yield g
        c = CounterMetricFamily("rankwatch_training_time_seconds",
                                "The job's wall time since its first step, by what it went to.",
                                labels=["node", "kind"])
        for kind in KINDS:
            c.add_metric([node, kind], breakdown[kind])
        yield c


def _restarts(node: str, decisions: list[Decision]) -> Iterable[Metric]:
    lbl = [node]
    restarts = CounterMetricFamily("rankwatch_restarts", "Restarts the coordinator decided.",
                                   labels=["node", "reason"])
    exclusions = CounterMetricFamily("rankwatch_exclusions", "Nodes excluded from the job.",
                                     labels=["node", "reason"])
    counts = dict.fromkeys(_RESTART_REASONS, 0)
    for d in decisions:
        if d.kind == "exclude":
            counts[restart_reason(d.reason)] += 1
    for reason, n in counts.items():
        restarts.add_metric([node, reason], n)
        exclusions.add_metric([node, reason], n)
    yield restarts
    yield exclusions
    g = GaugeMetricFamily("rankwatch_restart_generation", "The job's restart generation.",
                          labels=["node"])
    g.add_metric(lbl, max((d.generation for d in decisions), default=0))
    yield g
    g = GaugeMetricFamily("rankwatch_excluded_nodes", "Nodes currently excluded from the job.",
                          labels=["node"])
    g.add_metric(lbl, len({d.node for d in decisions if d.kind == "exclude"}))
    yield g


def _checkpoints(node: str, decisions: list[Decision], incidents: list[Incident]) -> Iterable[Metric]:
    lbl = [node]
    c = CounterMetricFamily("rankwatch_checkpoint_requests", "Checkpoints requested, by reason.",
                            labels=["node", "reason"])
    by_reason: dict[str, int] = {}
    for d in decisions:
        if d.kind == "checkpoint":
            by_reason[d.reason] = by_reason.get(d.reason, 0) + 1
    for reason, n in sorted(by_reason.items()):
        c.add_metric([node, reason], n)
    yield c
    saves = [i for i in incidents if i.kind == "checkpoint" and i.detail.get("ok")]
    if saves:
        last = max(saves, key=lambda i: i.step)
        g = GaugeMetricFamily("rankwatch_checkpoint_last_step", "Step of the last complete checkpoint.",
                              labels=["node"])
        g.add_metric(lbl, last.step)
        yield g
        g = GaugeMetricFamily("rankwatch_checkpoint_last_timestamp_seconds",
                              "When the last complete checkpoint finished (Unix seconds).", labels=["node"])
        g.add_metric(lbl, max(i.detected_at for i in saves))
        yield g
        secs = [float(i.detail.get("seconds", 0.0)) for i in saves]
        h = HistogramMetricFamily("rankwatch_checkpoint_save_seconds",
                                  "Training-thread time of checkpoint saves.", labels=["node"])
        buckets = [(str(b), float(sum(1 for s in secs if s <= b))) for b in _SAVE_BUCKETS]
        buckets.append(("+Inf", float(len(secs))))
        h.add_metric(lbl, buckets, sum(secs))
        yield h


def _coordination(node: str, coordinator: JobShown | None, relay: Relay | None) -> Iterable[Metric]:
    lbl = [node]
    g = GaugeMetricFamily("rankwatch_coordinator", "1 on the agent that coordinates the job.",
                          labels=["node"])
    g.add_metric(lbl, 1.0 if coordinator is not None else 0.0)
    yield g
    if coordinator is not None:
        g = GaugeMetricFamily("rankwatch_job_nodes", "Nodes the coordinator knows, by state.",
                              labels=["node", "state"])
        nodes = coordinator.node_states()
        for state in ("ok", "dead", "excluded"):
            g.add_metric([node, state], sum(1 for s in nodes.values() if s == state))
        yield g
        g = GaugeMetricFamily("rankwatch_job_rank_conflicts",
                              "Rank ids a second live node claims now (the first holder keeps each).",
                              labels=["node"])
        g.add_metric(lbl, float(len(coordinator.rank_conflicts(coordinator.clock()))))
        yield g
        relays = coordinator.relays
        g = GaugeMetricFamily("rankwatch_sync_relays",
                              "Relays the coordinator's nodes sync through (0: every node syncs directly).",
                              labels=["node"])
        g.add_metric(lbl, float(sum(1 for addr in relays.values() if not addr)))
        yield g
    if relay is not None:
        c = CounterMetricFamily("rankwatch_relayed_summaries",
                                "Other nodes' summaries this agent relayed to the coordinator.",
                                labels=["node"])
        c.add_metric(lbl, float(relay.relayed))
        yield c
