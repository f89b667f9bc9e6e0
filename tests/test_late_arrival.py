"""Who arrived last at each collective (a pure decision), and the node's per-step sums of it
from its ranks' real Report batches, through the node state's intake (no sleeping: times are
the records' own)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rankwatch.agent.detect.late_arrival import last_arrivals
from rankwatch.agent.detect.work_scores import RankWork, StragglerConfig, score
from rankwatch.agent.node.arrivals import Arrivals
from rankwatch.agent.node.intake import OPS, NodeState, Rejected
from rankwatch.proto import pb

ALL_REDUCE, SEND = OPS.index("all_reduce"), OPS.index("send")
T0 = 1.7e9


def test_the_last_member_is_late_by_its_issue_time_less_the_others_median():
    group = np.array([0, 0, 0, 1, 1, 0, 1])
    seq = np.array([5, 5, 5, 5, 5, 6, 9])
    start = np.array([1.0, 1.2, 1.05, 2.0, 2.5, 3.0, 4.0])
    late, matched = last_arrivals(group, seq, start)
    # (0, 5): 1.2 against the median of 1.0 and 1.05; (1, 5): 2.5 against 2.0; others alone.
    assert late == pytest.approx([0, 0.175, 0, 0, 0.5, 0, 0])
    assert matched.tolist() == [True, True, True, True, True, False, False]
    assert [a.size for a in last_arrivals(np.array([]), np.array([]), np.array([]))] == [0, 0]


def test_four_members_the_last_one_against_the_median_of_three():
    late, _ = last_arrivals(np.zeros(4), np.zeros(4), np.array([1.0, 1.3, 1.1, 1.2]))
    assert late == pytest.approx([0, 0.2, 0, 0])


def _hello(rank: int, pid: int) -> pb.Hello:
    return pb.Hello(rank=rank, world_size=4, pid=pid, node_id="n0", backend="gloo", op_names=list(OPS))


def _batch(seq: int, ops, seqs, starts, durations, names=("0",), steps=(), pgs=None) -> pb.Batch:
    n = len(ops)
    c = pb.CollectiveColumns(
        op=np.asarray(ops, "<u1").tobytes(), pg=np.asarray(pgs if pgs is not None else [0] * n, "<u2").tobytes(),
        seq=np.asarray(seqs, "<i8").tobytes(), start=np.asarray(starts, "<f8").tobytes(),
        duration=np.asarray(durations, "<f8").tobytes(), nbytes=np.full(n, 8, "<i8").tobytes(),
        pg_names=list(names))
    batch = pb.Batch(seq=seq, collectives=c)
    if steps:
        s = pb.StepColumns()
        for number, start, duration in steps:
            s.step.append(number)
            s.start.append(start)
            s.duration.append(duration)
            for col in (s.data, s.forward, s.backward, s.optimizer, s.tokens, s.flops, s.wait):
                col.append(0.0)
        batch.steps.CopyFrom(s)
    return batch


def test_a_rank_late_to_each_all_reduce_has_it_summed_per_step():
    """Two ranks, two steps of 0.1 s, one all-reduce each: rank 1 issues the second one 30 ms
    after rank 0; both complete together.  A send it issued late is not counted (P2P)."""
    st, arrivals = NodeState("n0", clock=lambda: T0 + 10), Arrivals(settle_seconds=0.5)
    st.collective_listeners.append(arrivals.on_collectives)
    st.step_listeners.append(arrivals.on_steps)
    r0, r1 = st.hello(_hello(0, 100)), st.hello(_hello(1, 101))
    steps = [(1, T0, 0.1), (2, T0 + 0.1, 0.1)]
    st.ingest(r0, _batch(1, [ALL_REDUCE, ALL_REDUCE, SEND], [1, 2, 3], [T0 + 0.05, T0 + 0.15, T0 + 0.16],
                         [0.01, 0.04, 0.01], steps=steps))
    st.ingest(r1, _batch(1, [ALL_REDUCE, ALL_REDUCE, SEND], [1, 2, 3], [T0 + 0.05, T0 + 0.18, T0 + 0.19],
                         [0.01, 0.01, 0.01], steps=steps))
    assert all(map(math.isnan, arrivals.for_rank(1, 2)))   # not settled yet
    arrivals.settle(T0 + 0.3)   # too soon: nothing settled
    assert all(map(math.isnan, arrivals.for_rank(1, 2)))
    arrivals.settle(T0 + 1.0)
    assert arrivals.for_rank(1, 2) == pytest.approx([0.0, 0.03])
    assert arrivals.for_rank(0, 2) == pytest.approx([0.0, 0.0])
    assert arrivals.for_rank(1, 1) == pytest.approx([0.0])   # aligned with a caller's older snapshot


def test_a_rank_late_to_two_groups_in_one_step_cost_the_step_its_delay_once():
    """dp 2 x tp 2 on one node: rank 2, 30 ms behind, arrives 30 ms late at its TP all-reduce
    (with rank 3) and again at its DP all-reduce (with rank 0).  The step lost 30 ms."""
    st, arrivals = NodeState("n0", clock=lambda: T0 + 10), Arrivals()
    st.collective_listeners.append(arrivals.on_collectives)
    st.step_listeners.append(arrivals.on_steps)
    ranks = {r: st.hello(_hello(r, 100 + r)) for r in (0, 2, 3)}
    tp, dp = "tp23", "dp02"
    issued = {0: [(dp, 0.02)], 3: [(tp, 0.02)], 2: [(tp, 0.05), (dp, 0.06)]}
    for r, ops in issued.items():
        names = sorted({g for g, _ in ops})
        st.ingest(ranks[r], _batch(1, [ALL_REDUCE] * len(ops), [1] * len(ops), [T0 + t for _, t in ops],
                                   [0.07 - t for _, t in ops], names=names,
                                   pgs=[names.index(g) for g, _ in ops], steps=[(1, T0, 0.1)]))
    arrivals.settle(T0 + 5)
    assert arrivals.for_rank(2, 1) == pytest.approx([0.04])   # the larger of 30 ms (rank 3) and 40 ms (rank 0)
    assert arrivals.for_rank(0, 1) == arrivals.for_rank(3, 1) == [0.0]


def test_a_rank_late_twice_in_one_step_for_the_same_peer_cost_it_both_times():
    """Expert parallelism on two ranks: rank 1 is stopped twice in one step and arrives late at
    its all-to-all (20 ms) and at the gradients' all-reduce in another group (10 ms): rank 0
    waited 30 ms."""
    st, arrivals = NodeState("n0", clock=lambda: T0 + 10), Arrivals()
    st.collective_listeners.append(arrivals.on_collectives)
    st.step_listeners.append(arrivals.on_steps)
    ranks = {r: st.hello(_hello(r, 100 + r)) for r in (0, 1)}
    issued = {0: [("ep", 0.02), ("dp_ep", 0.05)], 1: [("ep", 0.04), ("dp_ep", 0.06)]}
    for r, ops in issued.items():
        names = ["dp_ep", "ep"]
        st.ingest(ranks[r], _batch(1, [ALL_REDUCE] * 2, [1, 1], [T0 + t for _, t in ops], [0.005, 0.005],
                                   names=names, pgs=[names.index(g) for g, _ in ops], steps=[(1, T0, 0.1)]))
    arrivals.settle(T0 + 5)
    assert arrivals.for_rank(1, 1) == pytest.approx([0.03])


def test_records_without_group_names_are_not_lined_up_and_oversized_names_are_refused():
    st, arrivals = NodeState("n0", clock=lambda: T0 + 10), Arrivals()
    st.collective_listeners.append(arrivals.on_collectives)
    st.step_listeners.append(arrivals.on_steps)
    r0, r1 = st.hello(_hello(0, 100)), st.hello(_hello(1, 101))
    for r, at in ((r0, 0.05), (r1, 0.09)):
        st.ingest(r, _batch(1, [ALL_REDUCE], [1], [T0 + at], [0.01], names=(), steps=[(1, T0, 0.1)]))
    arrivals.settle(T0 + 5)
    assert arrivals.for_rank(1, 1) == [0.0]
    with pytest.raises(Rejected, match="process-group name over 128"):
        st.ingest(r0, _batch(2, [ALL_REDUCE], [2], [T0], [0.01], names=("g" * 129,)))
    with pytest.raises(Rejected, match="257 process-group names"):
        st.ingest(r0, _batch(2, [ALL_REDUCE], [2], [T0], [0.01], names=[str(i) for i in range(257)]))


def _work(rank: int, own: float, late: float, n: int = 16) -> RankWork:
    return RankWork(rank=rank, node="n0", step=n, own=[own] * n, data=[0.0] * n, wait=[0.0] * n,
                    step_seconds=0.1, completed=n, late=[late] * n)


def test_a_rank_the_others_wait_for_is_scored_by_its_late_arrival_when_its_own_work_is_normal():
    """Stopped inside its collectives, a rank's own work is normal; it arrives 30 ms late at
    the next ones.  The others' wait for it is its excess, and its slowdown counts it."""
    cfg = StragglerConfig(warmup_steps=0)
    s = {x.rank: x for x in score([_work(0, 0.05, 0.0), _work(1, 0.05, 0.03), _work(2, 0.05, 0.0)], cfg)}
    assert s[1].excess_seconds == pytest.approx(0.03) and s[1].slowdown == pytest.approx(1.6)
    assert s[0].slowdown == pytest.approx(1.0) and s[0].excess_seconds <= 0
    # A compute straggler arrives late by its extra work: that is not counted twice.
    s = {x.rank: x for x in score([_work(0, 0.05, 0.0), _work(1, 0.075, 0.025), _work(2, 0.05, 0.0)], cfg)}
    assert s[1].excess_seconds == pytest.approx(0.025) and s[1].slowdown == pytest.approx(1.5)


def test_a_rank_the_others_wait_longer_for_is_scored_by_that_wait_where_arrivals_are_unknown():
    """No late arrivals lined up (a rank alone on its node: the coordinator's view), but the
    others wait 30 ms a step more than it does in their collectives: they wait for it."""
    cfg = StragglerConfig(warmup_steps=0)
    ranks = [RankWork(rank=r, node=f"n{r}", step=16, own=[0.05] * 16, data=[0.0] * 16,
                      wait=[0.01 if r == 1 else 0.04] * 16, step_seconds=0.1, completed=16) for r in range(3)]
    s = {x.rank: x for x in score(ranks, cfg)}
    assert s[1].excess_seconds == pytest.approx(0.03) and s[1].slowdown == pytest.approx(1.6)
    assert s[0].excess_seconds <= 0 and s[2].excess_seconds <= 0


def test_with_stages_a_replica_that_waits_less_in_its_receives_is_not_credited():
    """Pipeline stages: rank 2 of stage 1 is stopped inside its receives from stage 0, so it
    waits 30 ms a step more than its replica rank 3, which waits for no one.  Waits there are
    receives the replicas do not share: rank 3 gets no excess for waiting less."""
    cfg = StragglerConfig(warmup_steps=0)
    ranks = [RankWork(rank=r, node="n0", step=16, own=[0.05] * 16, data=[0.0] * 16, role=r // 2,
                      wait=[0.04 if r == 2 else 0.01] * 16, step_seconds=0.1, completed=16) for r in range(4)]
    s = {x.rank: x for x in score(ranks, cfg)}
    assert s[3].excess_seconds <= 0 and s[3].slowdown == pytest.approx(1.0)
