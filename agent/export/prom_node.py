"""Prometheus export of a NodeState.

Naming follows Prometheus: ``rankwatch_`` prefix, base units, ``_seconds`` and
``_total``.  Per-rank series exist only for this node's own ranks, and never
as histograms; histograms are per node, by op.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)

from rankwatch import __version__
from rankwatch.agent.node.intake import OPS, PHASES, STATES, NodeState
from rankwatch.agent.wire.report import SNAPSHOT_REASONS

__all__ = ["NodeCollector"]

_MESH_DIMS = ("dp", "tp", "pp", "cp", "ep")


class NodeCollector:
    """``collect()`` renders the node's state; registered in the agent's own registry."""

    def __init__(self, state: NodeState,
                 stragglers: Callable[[], tuple[dict[int, str], float]] | None = None,
                 rank_grace: float = 60.0) -> None:
        self._state = state
        self._grace = rank_grace   # a disconnected rank's series stay this long, then go
        # ({rank: cause} of the flagged stragglers, the job's speed-up without them)
        self._stragglers = stragglers or (lambda: ({}, 1.0))

    def collect(self) -> Iterable[Metric]:
        st = self._state
        node = st.node_id
        now = st.clock()
        ranks = [r for r in st.snapshot() if r.connected or now - r.last_seen <= self._grace]
        info = InfoMetricFamily("rankwatch_agent", "The agent's version and node.")
        info.add_metric([], {"node": node, "version": __version__})
        yield info
        yield from self._rank_metrics(node, ranks)
        with st.lock:
            yield from self._node_metrics(node, st)
        yield from self._throughput(node, st)

    def _rank_metrics(self, node: str, ranks: list) -> Iterable[Metric]:
        lbl = ["node", "rank"]
        step = GaugeMetricFamily("rankwatch_rank_step", "Last step a rank reached.", labels=lbl)
        secs = GaugeMetricFamily("rankwatch_rank_step_seconds",
                                 "Median wall time of a rank's recent steps.", labels=lbl)
        phase = GaugeMetricFamily("rankwatch_rank_phase_seconds",
                                  "Median seconds per step a rank spent in each phase, over "
                                  "the steps rankwatch_rank_step_seconds is the median of.",
                                  labels=lbl + ["phase"])
        seq = GaugeMetricFamily("rankwatch_rank_collective_sequence",
                                "Highest collective sequence number a rank reported.", labels=lbl)
        colls = CounterMetricFamily("rankwatch_rank_collectives", "Collectives a rank completed.",
                                    labels=lbl + ["op"])
        dropped = CounterMetricFamily("rankwatch_rank_dropped_records",
                                      "Records a rank dropped (agent away or slow).", labels=lbl)
        conn = GaugeMetricFamily("rankwatch_rank_connected", "1 while a rank's stream is open.", labels=lbl)
        state = GaugeMetricFamily("rankwatch_rank_state", "1 for a rank's current state.",
                                  labels=lbl + ["state"])
        tps = GaugeMetricFamily("rankwatch_rank_tokens_per_second", "A rank's share of tokens/s.", labels=lbl)
        slow = GaugeMetricFamily("rankwatch_rank_straggler_slowdown_ratio",
                                 "A rank's own work over the other ranks' median (1 = even).", labels=lbl)
        own = GaugeMetricFamily("rankwatch_rank_own_work_seconds",
                                "Median per-step time a rank was not blocked in collectives.", labels=lbl)
        wait = GaugeMetricFamily("rankwatch_rank_collective_wait_seconds",
                                 "Median per-step time a rank was blocked in collectives.", labels=lbl)
        rinfo = InfoMetricFamily("rankwatch_rank", "A rank's process, backend and mesh coordinates.",
                                 labels=lbl)
        for r in ranks:
            key = [node, str(r.rank)]
            step.add_metric(key, r.step)
            secs.add_metric(key, r.step_seconds)
            phases = r.phase_seconds
            for name in PHASES:
                phase.add_metric(key + [name], phases.get(name, 0.0))
            seq.add_metric(key, r.last_collective_seq)
            for i, name in enumerate(OPS):
                if r.collective_counts[i]:
                    colls.add_metric(key + [name], float(r.collective_counts[i]))
            dropped.add_metric(key, r.dropped)
            conn.add_metric(key, 1.0 if r.connected else 0.0)
            for name in STATES:
                state.add_metric(key + [name], 1.0 if r.state == name else 0.0)
            tps.add_metric(key, r.tokens_per_second)
            slow.add_metric(key, r.slowdown)
            own.add_metric(key, r.own_work_seconds)
            wait.add_metric(key, r.comm_wait_seconds)
            mesh = {d: str(r.mesh_coords[d]) for d in _MESH_DIMS if d in r.mesh_coords}
            rinfo.add_metric(key, {"pid": str(r.pid), "backend": r.backend, "device": r.device,
                                   "local_rank": str(r.local_rank), **mesh,
                                   "mesh": ",".join(f"{k}={v}" for k, v in sorted(r.mesh_coords.items()))})
        yield from (step, secs, phase, seq, colls, dropped, conn, state, tps, slow, own, wait, rinfo)
        yield from self._straggler_metrics(node, {r.rank for r in ranks})
        yield from _snapshot_metrics(node, ranks)
        counts = GaugeMetricFamily("rankwatch_ranks", "This node's ranks by state.", labels=["node", "state"])
        for name in STATES:
            counts.add_metric([node, name], sum(1 for r in ranks if r.state == name))
        yield counts

    def _straggler_metrics(self, node: str, own_ranks: set[int]) -> Iterable[Metric]:
        causes, cost = self._stragglers()
        flag = GaugeMetricFamily("rankwatch_rank_straggler", "1 while a rank is flagged as a straggler, "
                                 "with its cause.", labels=["node", "rank", "cause"])
        for rank, cause in sorted(causes.items()):
            if rank in own_ranks:
                flag.add_metric([node, str(rank), cause], 1.0)
        yield flag
        g = GaugeMetricFamily("rankwatch_straggler_cost_ratio", "The job's step-time speed-up if the "
                              "current stragglers were gone (1 = none).", labels=["node"])
        g.add_metric([node], cost)
        yield g

    def _node_metrics(self, node: str, st: NodeState) -> Iterable[Metric]:
        h = HistogramMetricFamily("rankwatch_step_duration_seconds",
                                  "Wall time of steps on this node's ranks.", labels=["node"])
        h.add_metric([node], st.step_hist.cumulative(0), float(st.step_hist.sums[0]))
        yield h
        h = HistogramMetricFamily("rankwatch_collective_duration_seconds",
                                  "Collective latency, issue to completion, on this node's ranks.",
                                  labels=["node", "op"])
        b = CounterMetricFamily("rankwatch_collective_bytes", "Collective payload bytes.",
                                labels=["node", "op"])
        for i, op in enumerate(OPS):
            if st.coll_hist.count(i):
                h.add_metric([node, op], st.coll_hist.cumulative(i), float(st.coll_hist.sums[i]))
                b.add_metric([node, op], float(st.coll_bytes[i]))
        yield h
        yield b
        c = CounterMetricFamily("rankwatch_steps", "Steps completed by this node's ranks.", labels=["node"])
        c.add_metric([node], st.steps_total)
        yield c
        c = CounterMetricFamily("rankwatch_tokens", "Tokens processed (each rank's share).", labels=["node"])
        c.add_metric([node], st.tokens_total)
        yield c
        c = CounterMetricFamily("rankwatch_model_flops", "Model FLOPs (each rank's share).", labels=["node"])
        c.add_metric([node], st.flops_total)
        yield c
        c = CounterMetricFamily("rankwatch_records_received", "Records taken from ranks.",
                                labels=["node", "kind"])
        for kind, n in st.records.items():
            c.add_metric([node, kind], n)
        yield c
        c = CounterMetricFamily("rankwatch_messages_rejected", "Messages refused, by reason.",
                                labels=["node", "reason"])
        for reason, n in st.rejected.items():
            c.add_metric([node, reason], n)
        yield c
        c = CounterMetricFamily("rankwatch_dropped_records", "Records this node's ranks dropped.",
                                labels=["node"])
        c.add_metric([node], sum(r.dropped for r in st.ranks.values()))
        yield c
        g = GaugeMetricFamily("rankwatch_incidents", "Incidents this agent holds, by kind.",
                              labels=["node", "kind"])
        for kind in ("straggler", "hang", "gpu_fault", "rank_exit", "checkpoint", "restart"):
            g.add_metric([node, kind], sum(1 for i in st.incidents if i.kind == kind))
        yield g

    def _throughput(self, node: str, st: NodeState) -> Iterable[Metric]:
        g = GaugeMetricFamily("rankwatch_tokens_per_second", "Tokens/s of this node's ranks.",
                              labels=["node"])
        g.add_metric([node], st.tokens_per_second())
        yield g
        mfu = st.mfu()
        if mfu is not None:
            g = GaugeMetricFamily("rankwatch_mfu_ratio", "Model FLOPs utilisation of this node's ranks.",
                                  labels=["node"])
            g.add_metric([node], mfu)
            yield g


def _snapshot_metrics(node: str, ranks: list) -> Iterable[Metric]:
    """The in-process tier's peer snapshots, for the node's ranks that take them."""
    lbl = ["node", "rank"]
    memory = GaugeMetricFamily("rankwatch_rank_snapshot_memory_bytes",
                               "Host bytes a rank's peer snapshots hold (its own and its buddies' copies).",
                               labels=lbl)
    age = GaugeMetricFamily("rankwatch_rank_snapshot_age_steps",
                            "Steps since a rank's last peer snapshot (what a recovery from it recomputes).",
                            labels=lbl)
    shard = GaugeMetricFamily("rankwatch_rank_snapshot_shard_bytes",
                              "Bytes of a rank's own snapshot (its shards, optimizer state, step and RNG).",
                              labels=lbl)
    rate = GaugeMetricFamily("rankwatch_rank_snapshot_send_bytes_per_second",
                             "What a rank's last snapshot exchange with its buddy sent, per second.", labels=lbl)
    copy = GaugeMetricFamily("rankwatch_rank_snapshot_copy_seconds",
                             "How long a rank's last snapshot copy stalled its step.", labels=lbl)
    done = CounterMetricFamily("rankwatch_rank_snapshot_exchanges", "Snapshot exchanges a rank completed.",
                               labels=lbl)
    failed = CounterMetricFamily("rankwatch_rank_snapshot_failures", "Snapshots or exchanges that failed.",
                                 labels=lbl)
    every = GaugeMetricFamily("rankwatch_rank_snapshot_every_steps",
                              "Steps between a rank's peer snapshots, as planned (0: off).", labels=lbl)
    enabled = GaugeMetricFamily("rankwatch_rank_snapshot_enabled",
                                "1 if a rank takes peer snapshots, else 0; reason: why (fits, override, disabled, "
                                "memory, single_node, replicas, measuring).", labels=[*lbl, "reason"])
    for r in ranks:
        s = r.snapshot
        if s is None:
            continue
        key = [node, str(r.rank)]
        every.add_metric(key, s.every)
        enabled.add_metric([*key, SNAPSHOT_REASONS[s.reason]], 1.0 if s.every else 0.0)
        if s.step < 0:   # a plan without a snapshot yet (or none to take)
            continue
        memory.add_metric(key, s.memory_bytes)
        shard.add_metric(key, s.sent_bytes)
        age.add_metric(key, max(0, r.step - s.step) if s.step >= 0 else 0)
        rate.add_metric(key, s.sent_bytes / s.send_seconds if s.send_seconds > 0 else 0.0)
        copy.add_metric(key, s.copy_seconds)
        done.add_metric(key, s.exchanges)
        failed.add_metric(key, s.failures)
    yield from (memory, shard, age, rate, copy, done, failed, every, enabled)

