"""One detection function for a node's ranks and for the job's: evaluate(now, snapshot, config)."""

from __future__ import annotations

import os
import time

import pytest

from rankwatch.address import Address
from rankwatch.agent.wire import windows
from rankwatch.agent.job.coordinator import Coordinator, PolicyConfig
from rankwatch.agent.detect.evaluate import Snapshot, evaluate
from rankwatch.agent.detect.hang_verdict import HangConfig, RankProgress
from rankwatch.agent.durable.incidents import IncidentLog
from rankwatch.agent.node.rank_snapshot import snapshot
from rankwatch.agent.node.sweep import NodeWatch
from rankwatch.agent.node.rankexit import ExitConfig
from rankwatch.agent.server import Agent, AgentConfig
from rankwatch.agent.node.intake import OPS, NodeState
from rankwatch.agent.detect.straggler import StragglerConfig
from rankwatch.proto import pb

HANG = HangConfig(floor_seconds=1, first_step_seconds=1, silence_seconds=2)


def rank(r, *, progress_at=0.0, last_seen=100.0, seqs=None, inflight=None, **kw):
    return RankProgress(rank=r, node=kw.pop("node", "n0"), step=7, step_seconds=0.1, steps_completed=7,
                        activity="train", progress_at=progress_at, last_seen=last_seen, connected=True,
                        group_seqs=seqs or {}, inflight=inflight, pid=1000 + r, alive=True, **kw)


def test_a_stall_is_named_with_its_evidence_and_a_moving_job_is_not():
    waiting = {"op": "all_reduce", "group": "0", "seq": 9, "since": 1.0}
    ranks = [rank(0, seqs={"0": 9}, inflight=waiting), rank(1, seqs={"0": 8}, own=[0.1], data=[0.0], wait=[0.0])]
    found = evaluate(100.0, Snapshot(ranks=ranks, scope="node"), HANG).hang
    assert found is not None and (found.node, found.rank, found.step) == ("n0", 1, 7)
    d = found.detail
    assert d["collective"] == {"op": "all_reduce", "group": "0", "seq": 9, "source": "hooks"}
    assert d["reason"].startswith("behind the others") and d["pid"] == 1001 and d["alive"] is True
    assert d["stalled_seconds"] == 100.0 and d["allowance_seconds"] == 1.0 and d["silent_ranks"] == []
    assert d["stacks"] is None and "not run long enough" in d["stacks_note"]
    assert "scope" not in d and "nodes" not in d
    moving = [rank(0, progress_at=99.5), rank(1, progress_at=99.9)]
    assert evaluate(100.0, Snapshot(ranks=moving, scope="node"), HANG).hang is None


def test_job_scope_names_the_nodes_and_a_silent_nodes_rank_is_not_called_alive():
    ranks = [rank(0, node="a", last_seen=99.9), rank(1, node="b", last_seen=10.0)]
    snap = Snapshot(ranks=ranks, scope="job", nodes=("a", "b"), silent_nodes=frozenset({"b"}))
    found = evaluate(100.0, snap, HANG).hang
    assert found is not None and found.node == "b" and found.rank == 1
    assert found.detail["alive"] is None and found.detail["stacks_note"] == "the node's agent is silent"
    assert found.detail["scope"] == "job" and found.detail["nodes"] == ["a", "b"]


def test_a_stopped_culprit_says_why_it_has_no_stacks():
    ranks = [rank(0, last_seen=99.9), rank(1, last_seen=10.0, stopped=True)]
    d = evaluate(100.0, Snapshot(ranks=ranks, scope="node"), HANG).hang.detail
    assert d["stopped"] is True and "SIGSTOP" in d["stacks_note"]


def test_straggler_inputs_are_the_connected_ranks_windows():
    ranks = [rank(0, own=[0.1, 0.2], data=[0.0, 0.01], wait=[0.05, 0.0]), rank(1, own=[0.3])]
    ranks[1].connected = False
    work = evaluate(0.5, Snapshot(ranks=ranks, scope="node"), HANG).work
    assert [(w.rank, w.own, w.data, w.wait, w.completed) for w in work] == [
        (0, [0.1, 0.2], [0.0, 0.01], [0.05, 0.0], 7)]


def hello(r: int, pid: int) -> pb.Hello:
    return pb.Hello(rank=r, world_size=2, pid=pid, node_id="n0", backend="gloo", op_names=list(OPS))


def progress(state: NodeState, r, seq: int, step: int, group_seq: int) -> None:
    state.ingest(r, pb.Batch(seq=seq, progress=pb.Progress(step=step, group_seqs={"0": group_seq})))


def test_node_agent_and_coordinator_build_the_same_hang_incident(tmp_path):
    """The node's view of its ranks, and the coordinator's view of the same ranks through the
    node's summary, give one incident: the same culprit and the same evidence."""
    agent = Agent(AgentConfig(node_id="n0", listen=[Address(path=str(tmp_path / "a.sock"))],
                              metrics_port=None, hang=HANG))
    st = agent.state
    r0, r1 = st.hello(hello(0, os.getpid())), st.hello(hello(1, os.getppid()))
    progress(st, r0, 1, step=3, group_seq=5)
    progress(st, r1, 1, step=3, group_seq=4)   # rank 1 is behind on group 0
    coordinator = Coordinator("c", incidents=IncidentLog(None), hang=HANG,
                              policy=PolicyConfig(node_timeout_seconds=600))
    coordinator.sync(agent.summary(1))
    now = time.time() + 1.5   # past the allowance, within the silence window: both are waiting
    node = evaluate(now, snapshot(st, now), HANG).hang
    job = evaluate(now, coordinator.snapshot(now), HANG).hang
    assert node is not None and job is not None
    assert (node.node, node.rank, node.step) == (job.node, job.rank, job.step) == ("n0", 1, 3)
    assert job.detail.pop("scope") == "job" and job.detail.pop("nodes") == ["n0"]
    for key in ("stalled_seconds", "started_at"):   # the coordinator's clock offset moves these a little
        assert job.detail.pop(key) == pytest.approx(node.detail.pop(key), abs=0.05)
    assert job.detail == node.detail


def make_watch(clock):
    st = NodeState("n0", clock=clock)
    log = IncidentLog(None)
    return st, log, NodeWatch(st, log, hang=HANG, straggler=StragglerConfig(), exits=ExitConfig(),
                              gpu_throttle=lambda rank: [])


def hung_rank():
    """One rank that stalled past the allowance, and the hang incident it got."""
    now = [1000.0]
    st, log, watch = make_watch(lambda: now[0])
    r = st.hello(hello(0, os.getpid()))
    progress(st, r, 1, step=3, group_seq=5)
    now[0] += 5
    assert watch.check_hang(now[0]) is not None and st.ranks[0].state == "hung"
    return now, st, log, watch, r


def test_a_job_that_ends_while_hung_is_not_called_resumed():
    now, st, log, watch, r = hung_rank()
    st.goodbye(r, clean=True)   # SIGTERM: the rank closes its stream on its way out
    assert watch.check_hang(now[0] + 1) is None
    (inc,) = log.items
    assert inc.resolved_at == now[0] + 1 and inc.detail["outcome"] == "ended"


def completed(state: NodeState, r, seq: int, first: int, n: int) -> None:
    """``n`` completed steps from ``first`` (one batch of step columns)."""
    steps = list(range(first, first + n))
    cols = pb.StepColumns(step=steps, start=[1.0] * n, duration=[0.1] * n, data=[0.0] * n,
                          forward=[0.0] * n, backward=[0.0] * n, optimizer=[0.0] * n, tokens=[0] * n,
                          flops=[0.0] * n)
    state.ingest(r, pb.Batch(seq=seq, steps=cols))


def test_progress_after_a_hang_resolves_it_and_the_rank_is_ok_again():
    now, st, log, watch, r = hung_rank()
    completed(st, r, 2, first=3, n=1)   # the stuck step closing is no proof (an exception exit does it)
    assert watch.check_hang(now[0]) is None and log.items[0].resolved_at is None
    completed(st, r, 3, first=4, n=1)   # a second step is
    assert watch.check_hang(now[0]) is None
    (inc,) = log.items
    assert inc.resolved_at == now[0] and inc.detail["outcome"] == "resumed"
    assert st.ranks[0].state == "ok"


def test_the_summary_carries_each_ranks_period_from_step_start_to_step_start(tmp_path):
    """The coordinator has no step starts: the node sends the period it measured from them,
    and the coordinator's straggler inputs carry it (the hold is counted in it)."""
    agent = Agent(AgentConfig(node_id="n0", listen=[Address(path=str(tmp_path / "a.sock"))],
                              metrics_port=None, hang=HANG))
    st = agent.state
    r0 = st.hello(hello(0, os.getpid()))
    n, t0 = 20, time.time() - 5
    cols = pb.StepColumns(step=list(range(n)), start=[t0 + 0.04 * i for i in range(n)], duration=[0.005] * n,
                          data=[0.001 * i for i in range(n)], forward=[0.0] * n, backward=[0.0] * n,
                          optimizer=[0.0] * n, tokens=[0] * n, flops=[0.0] * n, wait=[0.002] * n)
    st.ingest(r0, pb.Batch(seq=1, steps=cols))   # a loader outside the step scope: 5 ms of 40
    (sent,) = agent.summary(1).ranks
    assert sent.step_seconds == pytest.approx(0.005) and sent.step_period == pytest.approx(0.04)
    # The windows go packed in one field (RankSummary.work), not as repeated doubles.
    assert len(sent.work) == 3 * n * windows.VALUE_BYTES and not sent.own_work and not sent.comm_wait
    coordinator = Coordinator("c", incidents=IncidentLog(None), hang=HANG,
                              policy=PolicyConfig(node_timeout_seconds=600))
    coordinator.sync(agent.summary(2))
    (w,) = coordinator.view.straggler_work(time.time())
    assert w.period == pytest.approx(0.04) and w.step_seconds == pytest.approx(0.005)
    assert list(w.own) == list(st.ranks[0].own_work) == pytest.approx([0.003] * n)
    assert list(w.data) == list(st.ranks[0].data_wait) and list(w.wait) == [0.002] * n
