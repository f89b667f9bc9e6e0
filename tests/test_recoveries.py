"""In-process recoveries, from the ranks' reports to the agents' incidents, status and metrics.

Real agents (in threads, real gRPC on Unix sockets) and the real rank side
(``Monitor.recovered`` through the real client): nothing is mocked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from datetime import timedelta

import pytest

from conftest import parse_metrics, wait_for
from rankwatch.address import Address
from rankwatch.agent.node import recoveries
from rankwatch.agent.job.coordinator import PolicyConfig
from rankwatch.agent.durable.incidents import Incident
from rankwatch.agent.server import Agent, AgentConfig
from rankwatch.hooks.instrument.client import AgentClient
from rankwatch.hooks.instrument.monitor import Monitor, NullMonitor
from rankwatch.hooks.instrument.recorder import OPS, Recorder
from rankwatch.proto import pb
from rankwatch.status import fetch_status

PHASES = {"left_step": 0.4, "agreed": 1.2, "reinitialised": 2.5, "restored": 3.0, "first_step": 4.5}


def monitor(addr: Address, rank: int, world: int, node: str = "n0") -> Monitor:
    """A rank's real Monitor and client, streaming to ``addr`` (no collective timers)."""
    rec = Recorder(capacity=1 << 12)
    hello = pb.Hello(rank=rank, world_size=world, local_rank=rank % 2, pid=os.getpid(), node_id=node,
                     backend="gloo", op_names=list(OPS))
    client = AgentClient(rec, hello, addr, flush_interval=timedelta(milliseconds=20))
    client.start()
    return Monitor(rec, None, client)


def recovered(mon: Monitor, started_at: float, rank_after: int, **over) -> None:
    args = dict(started_at=started_at, step=120, old_world_size=8, new_world_size=6, dropped_nodes=["n1"],
                phases=PHASES, ok=True, rank_after=rank_after)
    args.update(over)
    mon.recovered(**args)


def cli(addr: Address, *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "rankwatch.agent.cli", *args, "--agent", str(addr)],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout


def metric(agent: Agent, outcome: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{agent.metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return parse_metrics(text).get(("rankwatch_in_process_recoveries_total",
                                    frozenset({("node", "n0"), ("outcome", outcome)})), 0.0)


def in_process(status: dict) -> list[dict]:
    return [i for i in status["incidents"] if i["kind"] == "restart" and i["detail"].get("tier") == "in_process"]


@pytest.fixture
def agent(tmp_path):
    a = Agent(AgentConfig(node_id="n0", listen=[Address(path=str(tmp_path / "a.sock"))],
                          metrics_port=0, metrics_addr="127.0.0.1", state_dir=tmp_path / "state"))
    a.start()
    yield a
    a.stop(timedelta(seconds=0.5))


def test_two_ranks_of_a_node_report_one_recovery(agent):
    addr = agent.config.listen[0]
    mons = [monitor(addr, 2, 8), monitor(addr, 3, 8)]
    try:
        wait_for(lambda: len(agent.state.ranks) == 2, 10, what="both ranks connected")
        t = time.time() - 10
        # The two ranks caught the failure 0.7 s apart; each reports it once, alone in its batch.
        recovered(mons[0], t, rank_after=0)
        recovered(mons[1], t + 0.7, rank_after=1)
        wait_for(lambda: all(r.world_size == 6 for r in agent.state.ranks.values()), 10,
                 what="both reports taken")
        status = json.loads(cli(addr, "status", "--json"))
        (inc,) = in_process(status)
        assert [i["kind"] for i in status["incidents"]] == ["restart"]
        assert (inc["node"], inc["step"], inc["detected_at"]) == ("n0", 120, pytest.approx(t))
        d = inc["detail"]
        assert d == {"tier": "in_process", "ok": True, "step": 120, "old_world_size": 8, "new_world_size": 6,
                     "dropped_nodes": ["n1"], "phases": PHASES, "error": "", "started_at": pytest.approx(t)}
        assert metric(agent, "ok") == 1.0 and metric(agent, "failed") == 0.0
        # Each rank is in its new world now, as the coordinator will count it.
        ranks = {r.rank: r for r in agent.summary(1).ranks}
        assert {n: (r.world_size, r.world_rank) for n, r in ranks.items()} == {2: (6, 0), 3: (6, 1)}
        human = cli(addr, "status")
        assert "in-process recoveries (1)" in human and "8 -> 6 without n1" in human
        story = cli(addr, "diagnose", inc["id"])
        assert "in-process recovery on node n0 after step 120: recovered" in story
        assert "first_step        4.50 s" in story and "nodes left out: n1" in story

        # A failed attempt later is an incident of its own, and both ranks' reports are still one.
        for n, mon in enumerate(mons):
            recovered(mon, t + 5 + n * 0.3, rank_after=-1, step=130, old_world_size=6, new_world_size=4,
                      dropped_nodes=["n2"], phases={"left_step": 0.5, "agreed": 30.0}, ok=False,
                      error="membership not agreed: store timeout")
        wait_for(lambda: metric(agent, "failed") == 1.0, 10, what="the failed attempt counted")
        # Both ranks' reports of it taken (two of the first recovery, two of this attempt):
        # the second, had it been taken for a new recovery, would be an incident by now.
        wait_for(lambda: agent.recoveries.reports == 4, 10, what="the second rank's report taken")
        failed = [i for i in in_process(fetch_status(addr)) if not i["detail"]["ok"]]
        assert len(failed) == 1 and failed[0]["detail"]["error"] == "membership not agreed: store timeout"
        assert failed[0]["detail"]["phases"] == {"left_step": 0.5, "agreed": 30.0}
        assert metric(agent, "ok") == 1.0
        assert {r.world_size for r in agent.state.ranks.values()} == {6}, "a failed attempt moves no rank"
        assert "FAILED" in cli(addr, "diagnose", failed[0]["id"])
    finally:
        for mon in mons:
            mon.close()


def test_a_bad_record_is_refused_alone(agent):
    addr = agent.config.listen[0]
    mon = monitor(addr, 0, 4)
    try:
        wait_for(lambda: 0 in agent.state.ranks, 10, what="the rank connected")
        t = time.time()
        with mon.step(1):
            mon.mark("data")
        recovered(mon, t, rank_after=0, old_world_size=4, new_world_size=3,
                  phases={"left_step": 2.0, "agreed": 1.0})   # decreasing: refused
        recovered(mon, t + 30, rank_after=0, old_world_size=4, new_world_size=3)
        wait_for(lambda: len(in_process(fetch_status(addr))) == 1, 10, what="the good record taken")
        assert agent.state.rejected == {"invalid_value": 1}
        assert agent.state.records["step"] == 1, "the step in the bad record's batch was kept"
        (inc,) = in_process(fetch_status(addr))
        assert inc["detected_at"] == pytest.approx(t + 30)
    finally:
        mon.close()


def test_the_null_monitor_takes_a_recovery_and_does_nothing():
    assert NullMonitor().recovered(started_at=1.0, step=1, old_world_size=2, new_world_size=1,
                                   dropped_nodes=[], phases={}, ok=True, rank_after=0) is None


def test_a_report_that_does_not_fit_the_wire_never_raises(agent):
    mon = monitor(agent.config.listen[0], 0, 4)
    try:
        # A phase that is no number, a world size beyond int32: logged, not raised into training.
        recovered(mon, time.time(), rank_after=0, phases={"agreed": "soon"})
        recovered(mon, time.time(), rank_after=0, new_world_size=1 << 40)
    finally:
        mon.close()


@pytest.fixture
def job(tmp_path):
    """n0 coordinates, n3 is a node agent; of the old world of 8, n1 (ranks 2, 3) is lost and
    n2 (ranks 4, 5) trains on without an agent the coordinator hears."""
    socks = {n: Address(path=str(tmp_path / f"{n}.sock")) for n in ("n0", "n3")}
    agents = {n: Agent(AgentConfig(node_id=n, listen=[addr], metrics_port=None, coordinators=[socks["n0"]],
                                   sync_interval=0.05, policy=PolicyConfig(min_nodes=3)))
              for n, addr in socks.items()}
    for a in agents.values():
        a.start()
    yield agents
    for a in agents.values():
        a.stop(timedelta(seconds=0.2))


def test_the_coordinator_shows_one_recovery_per_job_and_counts_the_new_world(job):
    n0, n3 = job["n0"], job["n3"]
    wait_for(lambda: n0.is_coordinator() and set(n0.coordinator.nodes) == {"n0", "n3"}, 10,
             what="n0 coordinating both nodes")
    # n0's ranks 0, 1 keep their numbers; n3's ranks 6, 7 become 4, 5.
    placed = {"n0": ((0, 0), (1, 1)), "n3": ((6, 4), (7, 5))}
    mons = [(monitor(job[node].config.listen[0], rank, 8, node), after)
            for node, ranks in placed.items() for rank, after in ranks]
    try:
        wait_for(lambda: sum(len(n.summary.ranks) for n in n0.coordinator.nodes.values()) == 4, 10,
                 what="every rank at the coordinator")
        t = time.time() - 5
        for n, (mon, after) in enumerate(mons):
            recovered(mon, t + 0.2 * n, rank_after=after)   # each node's clock a little apart
        wait_for(lambda: all(r.world_size == 6 and r.HasField("world_rank")
                             for n in n0.coordinator.nodes.values() for r in n.summary.ranks), 10,
                 what="every rank's new world at the coordinator")
        wait_for(lambda: any(recoveries.is_in_process(i) for i in n0.coordinator.job_incidents()), 10,
                 what="n3's recovery incident at the coordinator")
        job_status = fetch_status(n0.config.listen[0])
        (inc,) = in_process(job_status)
        assert inc["detail"]["dropped_nodes"] == ["n1"] and inc["detail"]["phases"] == PHASES
        assert len(in_process(fetch_status(n3.config.listen[0]))) == 1, "n3 keeps its own"
        # n2's ranks (2, 3 of the new world) are missing: one node without an agent, so
        # excluding n3 would leave two nodes, below the minimum of three.
        assert n0.coordinator.exclude("n3", "test") is None
    finally:
        for mon, _ in mons:
            mon.close()


def test_reports_of_one_recovery_match_by_step_worlds_outcome_and_time():
    def inc(at, **over):
        detail = {"tier": "in_process", "ok": True, "step": 10, "old_world_size": 4, "new_world_size": 3}
        detail.update(over)
        return Incident(id="x", kind="restart", node="n0", rank=0, step=10, detected_at=at, detail=detail)

    a = inc(100.0)
    assert recoveries.same(a, inc(100.0 + recoveries.MATCH_SECONDS))
    assert not recoveries.same(a, inc(100.0 + recoveries.MATCH_SECONDS + 0.1))
    for over in ({"step": 11}, {"old_world_size": 5}, {"new_world_size": 2}, {"ok": False}):
        assert not recoveries.same(a, inc(100.5, **over)), over
    assert recoveries.span(inc(100.0, phases={"left_step": 1.0, "agreed": 2.0})) == (100.0, 102.0)
    assert recoveries.span(inc(100.0, phases={"agreed": 2.0, "first_step": 5.0})) == (100.0, 105.0)
    assert recoveries.span(inc(100.0)) == (100.0, 100.0)


def test_the_timeline_and_the_demo_feed_tell_a_recovery_in_one_line():
    from rankwatch.agent.cli.screen import DemoNotes, feed
    from rankwatch.agent.cli.status_tables import brief

    detail = {"tier": "in_process", "ok": False, "step": 7, "old_world_size": 4, "new_world_size": 3,
              "dropped_nodes": ["n2"], "phases": {"left_step": 0.25}, "error": "peer gone", "started_at": 5.0}
    line = brief(detail)
    assert line == ("in-process recovery after step 7 FAILED after 0.25s (world 4 -> 3 without n2): "
                    "peer gone (left_step 0.25s)")
    status = {"incidents": [{"id": "restart-1", "kind": "restart", "node": "n0", "rank": 1, "step": 7,
                             "detected_at": 5.0, "detail": detail}]}
    ((_, _, text),) = feed(status, DemoNotes(nodes=("n0",), spare="", hung="", xid="", steps=10))
    assert text.endswith(line)


def test_an_exclusion_is_answered_by_the_in_process_recovery_that_left_its_node_out():
    from rankwatch.agent.durable.incidents import Incident
    from rankwatch.agent.node.recoveries import handled_at

    def rec(at: float, dropped: list[str], ok: bool = True, first_step: float | None = 0.4) -> Incident:
        phases = {"left_step": 0.01, "agreed": 0.05}
        if first_step is not None:
            phases["first_step"] = first_step
        return Incident(id="r", kind="restart", node="n0", rank=0, step=10, detected_at=at,
                        detail={"tier": "in_process", "ok": ok, "dropped_nodes": dropped, "phases": phases})

    # A dead node: its survivors regrouped at once; the coordinator excluded it 3 s later.
    assert handled_at("n2", 103.0, [rec(100.0, ["n2"])]) == pytest.approx(100.4)
    # A hung node: excluded first; its workers killed, then the survivors regrouped.
    assert handled_at("n2", 100.0, [rec(100.6, ["n2"])]) == pytest.approx(101.0)
    # Not an answer: another node, a failed attempt, one not yet stepping, one long before.
    assert handled_at("n2", 100.0, [rec(100.5, ["n1"]), rec(100.5, ["n2"], ok=False),
                                    rec(100.5, ["n2"], first_step=None), rec(10.0, ["n2"])]) is None
