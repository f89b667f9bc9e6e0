"""The peer snapshots' stats, from the tier to /metrics: the monitor records the latest, the
batch builder sends it once, the agent checks its ranges and exports memory, age in steps and
the exchange's bandwidth (hooks/instrument/batches.py, agent/wire/report.py,
agent/export/prom_node.py), through a real Recorder, BatchBuilder, NodeState and collector."""

from __future__ import annotations

from collections import deque

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from conftest import parse_metrics
from rankwatch.agent.export.prom_node import NodeCollector
from rankwatch.agent.node.intake import OPS, NodeState, Rejected
from rankwatch.hooks.instrument.batches import BatchBuilder
from rankwatch.hooks.instrument.recorder import Recorder
from rankwatch.hooks.recovery.snapshot import Stats
from rankwatch.proto import pb


class _Monitor:
    """The monitor's recording side: what ``Monitor.peer_snapshot`` does with its recorder."""

    def __init__(self, rec: Recorder) -> None:
        self.recorder = rec

    from rankwatch.hooks.instrument.monitor import Monitor
    peer_snapshot = Monitor.peer_snapshot


def _batch(builder: BatchBuilder) -> tuple[pb.Batch, int]:
    return builder.build(deque(), deque(), lambda: 0)


def _metrics(st: NodeState) -> dict:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(NodeCollector(st))
    return parse_metrics(generate_latest(reg).decode())


def test_a_snapshot_reaches_the_agents_metrics_once_with_its_age_and_bandwidth():
    rec = Recorder()
    builder = BatchBuilder(rec, 64, lambda: -1, dict)
    mon = _Monitor(rec)
    assert not _batch(builder)[0].HasField("snapshot")   # none taken: none sent
    mon.peer_snapshot(Stats(step=40, copy_seconds=0.004, send_seconds=0.5, sent_bytes=2_000_000,
                            held_bytes=2_000_000, exchanges=3, failures=1, memory_bytes=4_000_000))
    batch, n = _batch(builder)
    assert batch.HasField("snapshot") and n >= 1 and batch.snapshot.step == 40
    assert not _batch(builder)[0].HasField("snapshot")   # the same stats are not sent again

    st = NodeState("n0")
    r = st.hello(pb.Hello(rank=0, world_size=2, pid=1000, node_id="n0", backend="gloo", op_names=list(OPS)))
    st.ingest(r, batch)
    st.ingest(r, pb.Batch(seq=batch.seq + 1, progress=pb.Progress(step=47)))
    m = _metrics(st)
    key = frozenset({("node", "n0"), ("rank", "0")})
    assert m[("rankwatch_rank_snapshot_memory_bytes", key)] == 4_000_000
    assert m[("rankwatch_rank_snapshot_shard_bytes", key)] == 2_000_000
    assert m[("rankwatch_rank_snapshot_age_steps", key)] == 7
    assert m[("rankwatch_rank_snapshot_send_bytes_per_second", key)] == pytest.approx(4_000_000)
    assert m[("rankwatch_rank_snapshot_copy_seconds", key)] == pytest.approx(0.004)
    assert m[("rankwatch_rank_snapshot_exchanges_total", key)] == 3
    assert m[("rankwatch_rank_snapshot_failures_total", key)] == 1


def test_a_rank_without_snapshots_has_no_series():
    st = NodeState("n0")
    st.hello(pb.Hello(rank=0, world_size=2, pid=1000, node_id="n0", backend="gloo", op_names=list(OPS)))
    assert not [k for k in _metrics(st) if k[0].startswith("rankwatch_rank_snapshot_")]


@pytest.mark.parametrize("bad", [dict(step=-2), dict(memory_bytes=1 << 53), dict(send_seconds=float("nan")),
                                 dict(copy_seconds=-1.0), dict(failures=1 << 60)])
def test_snapshot_stats_out_of_range_refuse_the_batch_whole(bad):
    st = NodeState("n0")
    r = st.hello(pb.Hello(rank=0, world_size=2, pid=1000, node_id="n0", backend="gloo", op_names=list(OPS)))
    with pytest.raises(Rejected):
        st.ingest(r, pb.Batch(seq=1, snapshot=pb.SnapshotStats(**{"step": 1, **bad})))
    assert r.snapshot is None and r.last_batch_seq == 0


def test_a_recovery_from_a_snapshot_reports_the_steps_it_recomputes_and_the_snapshots_copy_and_send():
    from rankwatch.agent.durable.incidents import IncidentLog
    from rankwatch.agent.node.recoveries import RecoveryLog

    rec = pb.RecoveryRecord(started_at=1.7e9, step=40, old_world_size=3, new_world_size=2, dropped_nodes=["n1"],
                            ok=True, phases={"left_step": 0.01, "resharded": 0.05, "first_step": 0.2}, rank_after=0,
                            failed_at=43, snapshot=pb.SnapshotStats(step=40, copy_seconds=0.004, send_seconds=0.3,
                                                                    sent_bytes=1 << 20))
    st = NodeState("n0")
    r = st.hello(pb.Hello(rank=0, world_size=3, pid=1000, node_id="n0", backend="gloo", op_names=list(OPS)))
    (taken,) = st.take_recoveries(r, [rec])
    inc = RecoveryLog("n0", IncidentLog(None)).record(0, taken)
    assert inc.detail["recomputed_steps"] == 3
    assert inc.detail["snapshot"] == {"step": 40, "copy_seconds": 0.004, "send_seconds": 0.3, "bytes": 1 << 20}
    bad = pb.RecoveryRecord()
    bad.CopyFrom(rec)
    bad.snapshot.send_seconds = float("inf")
    assert st.take_recoveries(r, [bad]) == []   # refused alone


def test_the_plan_reaches_the_metrics_with_its_reason_before_any_snapshot():
    """Snapshots off (or not yet taken): the plan alone is sent, as ``every`` and a reason."""
    from rankwatch.agent.wire.report import SNAPSHOT_REASONS
    from rankwatch.hooks.recovery.budget import REASONS

    assert SNAPSHOT_REASONS == REASONS   # the wire's numbers mean the same on both sides
    rec = Recorder()
    builder = BatchBuilder(rec, 64, lambda: -1, dict)
    _Monitor(rec).peer_snapshot(Stats(every=0, reason=REASONS.index("memory")))
    batch, _ = _batch(builder)
    st = NodeState("n0")
    r = st.hello(pb.Hello(rank=0, world_size=2, pid=1000, node_id="n0", backend="gloo", op_names=list(OPS)))
    st.ingest(r, batch)
    m = _metrics(st)
    key = frozenset({("node", "n0"), ("rank", "0")})
    assert m[("rankwatch_rank_snapshot_every_steps", key)] == 0
    assert m[("rankwatch_rank_snapshot_enabled", key | {("reason", "memory")})] == 0
    assert ("rankwatch_rank_snapshot_age_steps", key) not in m   # no snapshot: no age

    _Monitor(rec).peer_snapshot(Stats(step=40, every=25, reason=REASONS.index("fits"), exchanges=1))
    st.ingest(r, _batch(builder)[0])
    m = _metrics(st)
    assert m[("rankwatch_rank_snapshot_every_steps", key)] == 25
    assert m[("rankwatch_rank_snapshot_enabled", key | {("reason", "fits")})] == 1


def test_a_reason_outside_the_fixed_set_refuses_the_batch():
    st = NodeState("n0")
    r = st.hello(pb.Hello(rank=0, world_size=2, pid=1000, node_id="n0", backend="gloo", op_names=list(OPS)))
    with pytest.raises(Rejected):
        st.ingest(r, pb.Batch(seq=1, snapshot=pb.SnapshotStats(step=1, reason=7)))
