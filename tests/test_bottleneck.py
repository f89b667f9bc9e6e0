"""The job's bottleneck: the rule (agent/detect/bottleneck.py), a node's make-up from its ranks'
steps, its range checks on the wire, and the coordinator's job view from the nodes' summaries."""

from __future__ import annotations

import math

import pytest

from rankwatch.agent.detect.bottleneck import (
    BottleneckConfig, BottleneckState, BottleneckWatch, Part, combine, decide, rank_part, shares_of,
)
from rankwatch.agent.durable.incidents import IncidentLog
from rankwatch.agent.job.coordinator import Coordinator
from rankwatch.agent.node import makeup
from rankwatch.agent.node.intake import OPS, NodeState
from rankwatch.agent.views.answer import node_summary
from rankwatch.agent.wire.ranges import Rejected
from rankwatch.agent.wire.summary import check_makeup, check_summary
from rankwatch.proto import pb
from rankwatch.status import status_dict

CFG = BottleneckConfig()


def rank(step=0.1, data=0.0, wait=0.0, n=32):
    """A rank's windows: ``n`` steps of ``step`` seconds, ``data`` of them data wait and
    ``wait`` blocked in collectives (own work = step - wait)."""
    return [step - wait] * n, [data] * n, [wait] * n


def part(step=0.1, data=0.0, wait=0.0, n=32):
    return rank_part(*rank(step, data, wait, n), CFG)


def test_null_until_enough_steps():
    assert part(n=CFG.min_steps - 1) is None
    assert part(n=CFG.min_steps) is not None
    assert combine([None, None], CFG) is None
    assert BottleneckWatch().update(0.0, None) is None


def test_every_rank_waiting_for_data_is_input_bound():
    p = combine([part(0.4, data=0.3, wait=0.02), part(0.4, data=0.3, wait=0.03)], CFG)
    assert p.ranks == 2 and p.seen == 2
    v = decide(0.0, BottleneckState(), p, CFG).verdict
    assert v.kind == "input" and v.share == pytest.approx(0.75)
    assert sum(v.shares.values()) == pytest.approx(1.0)


def test_medians_ignore_a_few_slow_steps():
    own, data, wait = rank(0.1, data=0.01, wait=0.01)
    for i in range(0, 32, 8):   # a save or an eval now and then: 4 steps in 32 of 5 s of data
        own[i] += 5.0
        data[i] = 5.0
    assert shares_of(rank_part(own, data, wait, CFG))["input"] == pytest.approx(0.1)


def test_waiting_for_a_slower_peer_is_not_communication():
    # Rank 1 computes 0.3 s longer; rank 0 waits for it in its all-reduce.  Both step 0.5 s.
    slow = part(0.5, data=0.01, wait=0.02)
    fast = part(0.5, data=0.01, wait=0.32)
    job = combine([fast, slow], CFG)
    assert job.ranks == 1 and job.seen == 2
    v = decide(0.0, BottleneckState(), job, CFG).verdict
    assert v.kind == "compute" and v.shares["communication"] == pytest.approx(0.04)


def test_collective_wait_every_rank_pays_is_communication():
    v = decide(0.0, BottleneckState(), combine([part(0.2, 0.01, 0.15), part(0.2, 0.01, 0.14)], CFG), CFG).verdict
    assert v.kind == "communication" and v.share > 0.7


def test_one_data_straggler_makes_the_job_input_bound_through_it():
    job = combine([part(0.5, data=0.35, wait=0.01), part(0.5, data=0.01, wait=0.35), part(0.5, 0.01, 0.34)], CFG)
    assert job.ranks == 1
    assert decide(0.0, BottleneckState(), job, CFG).verdict.kind == "input"


def test_hysteresis_holds_a_kind_until_another_leads_long_enough():
    cfg = BottleneckConfig(margin=0.05, hold_seconds=3.0)
    s = decide(0.0, BottleneckState(), Part(step=1.0, data=0.5, wait=0.0, own=1.0), cfg)
    assert s.verdict.kind == "input"
    # Compute leads by less than the margin: input stays, whatever the time.
    for t in range(1, 10):
        s = decide(float(t), s, Part(step=1.0, data=0.48, wait=0.0, own=1.0), cfg)
        assert s.verdict.kind == "input" and s.challenger is None
    # It leads by more, but not for hold_seconds without a break: input stays.
    s = decide(10.0, s, Part(step=1.0, data=0.3, wait=0.0, own=1.0), cfg)
    s = decide(12.0, s, Part(step=1.0, data=0.3, wait=0.0, own=1.0), cfg)
    s = decide(12.5, s, Part(step=1.0, data=0.49, wait=0.0, own=1.0), cfg)   # the lead breaks
    s = decide(14.0, s, Part(step=1.0, data=0.3, wait=0.0, own=1.0), cfg)
    assert s.verdict.kind == "input" and s.verdict.share == pytest.approx(0.3)
    s = decide(16.9, s, Part(step=1.0, data=0.3, wait=0.0, own=1.0), cfg)
    assert s.verdict.kind == "input"
    s = decide(17.0, s, Part(step=1.0, data=0.3, wait=0.0, own=1.0), cfg)
    assert s.verdict.kind == "compute" and s.verdict.since == 17.0 and s.verdict.share == pytest.approx(0.7)
    assert decide(18.0, s, None, cfg) == BottleneckState()   # no steps: null again


def test_shares_stay_in_range_when_medians_do_not_add_up():
    sh = shares_of(Part(step=1.0, data=0.9, wait=0.6, own=0.4))
    assert sh["input"] + sh["communication"] == pytest.approx(1.0) and sh["compute"] == pytest.approx(0.0, abs=1e-9)
    assert all(0.0 <= v <= 1.0 for v in sh.values())


def test_nodes_combine_like_their_ranks_and_carry_gpu_utilisation():
    a = combine([part(0.4, 0.3, 0.02)] * 3, CFG)
    b = Part(**{**combine([part(0.4, 0.3, 0.04)], CFG).__dict__, "gpu_utilization": 0.2})
    job = combine([a, b], CFG)
    assert job.ranks == 4 and job.seen == 4
    assert job.wait == pytest.approx((3 * 0.02 + 0.04) / 4)
    assert job.gpu_utilization == pytest.approx(0.2)   # only node b reads a GPU


def _node(name: str, ranks: list[tuple[list, list, list]]) -> NodeState:
    """A node whose ranks reported these windows through the intake (real batches)."""
    st = NodeState(name)
    for i, (own, data, wait) in enumerate(ranks):
        r = st.hello(pb.Hello(rank=i, world_size=len(ranks) * 2, pid=1000 + i, node_id=name, backend="gloo",
                              op_names=list(OPS)))
        n = len(own)
        cols = pb.StepColumns(step=list(range(1, n + 1)), start=[1e9 + k for k in range(n)],
                              duration=[o + w for o, w in zip(own, wait)], data=data, forward=[0.0] * n,
                              backward=[0.0] * n, optimizer=[0.0] * n, tokens=[0.0] * n, flops=[0.0] * n,
                              wait=wait)
        st.ingest(r, pb.Batch(seq=1, steps=cols))
    return st


def test_a_node_reads_its_ranks_and_the_coordinator_the_nodes_summaries():
    data_bound = _node("n0", [rank(0.4, 0.3, 0.02), rank(0.4, 0.3, 0.03)])
    p0 = makeup.node_part(data_bound, CFG, lambda: 0.35)
    assert p0.ranks == 2 and p0.gpu_utilization == 0.35
    comm_bound = _node("n1", [rank(0.4, 0.01, 0.3), rank(0.4, 0.01, 0.295)])
    p1 = makeup.node_part(comm_bound, CFG)
    # Node n1's ranks wait 0.3 s a step for node n0's loaders: the job is input-bound.
    c = Coordinator("n0", incidents=IncidentLog(None))
    for seq, (st, p) in enumerate([(data_bound, p0), (comm_bound, p1)], 1):
        s = node_summary(st, seq, decisions=[], run_id="r", relay_address=None,
                         step_period=lambda _r, secs: secs, makeup=p)
        assert s.step_makeup.ranks == 2
        c.sync(s)
    job = combine(c.view.makeups(c.clock()), CFG)
    v = decide(0.0, BottleneckState(), job, CFG).verdict
    assert (v.kind, job.ranks, job.seen) == ("input", 2, 4) and v.share == pytest.approx(0.75)
    shown = status_dict(pb.StatusResponse(bottleneck=makeup.verdict_pb(v, "job")))["bottleneck"]
    assert shown["kind"] == "input" and shown["share"] == pytest.approx(0.75) and shown["scope"] == "job"
    assert shown["gpu_utilization"] == pytest.approx(0.35) and shown["ranks_seen"] == 4
    assert status_dict(pb.StatusResponse())["bottleneck"] is None


def test_an_excluded_or_older_node_is_left_out():
    c = Coordinator("n0", incidents=IncidentLog(None))
    st = _node("n1", [rank(0.4, 0.3, 0.02)])
    c.sync(node_summary(st, 1, decisions=[], run_id="r", relay_address=None, step_period=lambda _r, s: s))
    assert c.view.makeups(c.clock()) == []   # no make-up sent (an older agent, or too few steps)


@pytest.mark.parametrize("field,value", [
    ("step_seconds", math.nan), ("data_seconds", -1.0), ("wait_seconds", math.inf), ("own_seconds", 1e9),
    ("ranks", 5), ("steps", 10 ** 6), ("gpu_utilization", 1.5), ("gpu_utilization", math.nan),
])
def test_a_makeup_out_of_range_is_refused(field, value):
    m = makeup.to_pb(Part(step=0.4, data=0.3, wait=0.02, own=0.38, ranks=2, seen=2, steps=32))
    check_makeup(m)
    setattr(m, field, value)
    with pytest.raises(Rejected):
        check_makeup(m)
    s = pb.NodeSummary(node_id="n1", seq=1, sent_at=1e9)
    s.step_makeup.CopyFrom(m)
    with pytest.raises(Rejected):
        check_summary(s, now=1e9)


def test_the_config_is_checked():
    with pytest.raises(ValueError):
        BottleneckConfig(tolerance=1.0)
    with pytest.raises(ValueError):
        BottleneckConfig(min_steps=0)
