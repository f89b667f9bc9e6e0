"""Coordinator election through etcd: one coordinator per lease, a dead one replaced within its TTL,
and the job's decision log kept in etcd.  Real etcd processes on loopback, real agents."""

from __future__ import annotations

import signal
import time

import pytest

from conftest import AgentProcess, wait_for
from etcdcluster import EtcdCluster
from rankwatch.agent.durable.decisions import DecisionLog
from rankwatch.agent.link.election import Election, EtcdDecisions, parse_endpoints

pytestmark = [pytest.mark.e2e, pytest.mark.light]


@pytest.fixture
def etcd(tmp_path):
    cluster = EtcdCluster(tmp_path)
    try:
        yield cluster
    finally:
        cluster.stop()


def elections(cluster: EtcdCluster, n: int, job: str = "j", ttl: int = 2) -> list[Election]:
    endpoints = parse_endpoints("etcd://" + ",".join(cluster.endpoints))
    return [Election(endpoints, job, f"10.0.0.{i}:9000", ttl=ttl) for i in range(n)]


def crash(e: Election) -> None:
    """Stop campaigning without handing the key back, as a killed agent does."""
    e._stop.set()
    e._thread.join(5)


def test_endpoints_parse_and_bad_ones_are_refused():
    assert parse_endpoints("etcd://a:1,[::1]:2379") == [("a", 1), ("::1", 2379)]
    for bad in ("a:1", "etcd://a", "etcd://a:0", "etcd://:5", "etcd://a:x"):
        with pytest.raises(ValueError):
            parse_endpoints(bad)


def test_one_leader_and_a_crashed_one_replaced_within_its_ttl(etcd):
    a, b = elections(etcd, 2)
    for e in (a, b):
        e.start()
    try:
        assert a.is_leader() != b.is_leader()
        leader, other = (a, b) if a.is_leader() else (b, a)
        wait_for(lambda: other.leader() == leader.me, 5, what="the follower reading the leader")
        crash(leader)
        t0 = time.monotonic()
        wait_for(other.is_leader, 10, what="the follower taking over")
        assert time.monotonic() - t0 <= leader.ttl + 1.5
        assert not leader.is_leader(), "a leader that stopped refreshing no longer claims the role"
    finally:
        for e in (a, b):
            e.stop()


def test_a_graceful_leader_hands_over_at_once(etcd):
    a, b = elections(etcd, 2, ttl=10)
    a.start()
    b.start()
    try:
        leader, other = (a, b) if a.is_leader() else (b, a)
        leader.stop()
        t0 = time.monotonic()
        wait_for(other.is_leader, 10, what="the follower taking over")
        assert time.monotonic() - t0 < 10 - 2, "waited out the TTL: the key was not handed back"
    finally:
        b.stop()
        a.stop()


def test_decisions_in_etcd_continue_under_a_new_coordinator(etcd):
    (e,) = elections(etcd, 1)
    first = DecisionLog(run_id="r1")
    first.sink = e.decisions.append
    first.decide("exclude", now=1.0, node="n2", reason="dead")
    first.decide("checkpoint", now=2.0, step=40, reason="operator")
    # A new coordinator with nothing on disk and no node to tell it: the log is in etcd.
    second = DecisionLog(run_id="r1")
    assert [d.id for d in second.adopt(EtcdDecisions(e._client, "j").load())] == ["r1/exclude-1",
                                                                                 "r1/checkpoint-2"]
    d = second.decide("exclude", now=3.0, node="n1", reason="hang")
    assert (d.id, d.seq, d.generation) == ("r1/exclude-3", 3, 2)
    # A record that is not a decision (another writer's) is left out, not taken.
    e._client.write("/rankwatch/j/decisions/0000000099", '{"kind": "exclude", "seq": -1}')
    assert len(EtcdDecisions(e._client, "j").load()) == 2


def _coordinator(agents: list[AgentProcess]) -> list[str]:
    return [a.node for a in agents if a.proc.poll() is None and a.status()["coordinator"]]


def test_agents_elect_one_coordinator_and_replace_a_killed_one(tmp_path, etcd):
    args = ("--election", f"etcd://{etcd.endpoints[0]}", "--job-id", "job1", "--listen", "127.0.0.1:0")
    agents = [AgentProcess(tmp_path / f"n{i}.sock", node=f"n{i}", extra=args).start() for i in range(3)]
    try:
        first = wait_for(lambda: (c := _coordinator(agents)) and len(c) == 1 and c, 15,
                         what="one coordinator")[0]
        wait_for(lambda: all(a.status()["coordinator_node"] == first for a in agents), 10,
                 what="every agent syncing to it")
        dead = next(a for a in agents if a.node == first)
        dead.kill(signal.SIGKILL)
        t0 = time.monotonic()
        alive = [a for a in agents if a is not dead]
        second = wait_for(lambda: (c := _coordinator(alive)) and len(c) == 1 and c, 15,
                          what="a new coordinator")[0]
        took = time.monotonic() - t0
        assert second != first and took <= 6.0, f"took over after {took:.1f}s"
        wait_for(lambda: all(a.status()["coordinator_node"] == second for a in alive), 10,
                 what="the survivors syncing to the new coordinator")
        new = next(a for a in alive if a.node == second)
        assert {a.node for a in alive} <= set(new.status()["nodes"])
    finally:
        for a in agents:
            a.stop()


def test_a_paused_coordinator_steps_down_when_it_runs_again(tmp_path, etcd):
    """SIGSTOP the coordinator's agent past its lease; another takes over; SIGCONT the old one:
    it must not act as coordinator again (two never act at once)."""
    args = ("--election", f"etcd://{etcd.endpoints[0]}", "--job-id", "job2", "--listen", "127.0.0.1:0")
    agents = [AgentProcess(tmp_path / f"n{i}.sock", node=f"n{i}", extra=args).start() for i in range(2)]
    try:
        first = wait_for(lambda: (c := _coordinator(agents)) and len(c) == 1 and c, 15,
                         what="one coordinator")[0]
        old = next(a for a in agents if a.node == first)
        new = next(a for a in agents if a is not old)
        old.proc.send_signal(signal.SIGSTOP)
        try:
            wait_for(lambda: new.status()["coordinator"], 15, what="the other agent taking over")
        finally:
            old.proc.send_signal(signal.SIGCONT)
        # From the moment it runs again, at every look: one coordinator, and not the old one.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            assert _coordinator(agents) == [new.node]
        assert old.status()["coordinator_node"] == new.node
    finally:
        for a in agents:
            a.stop()


def test_the_election_survives_a_dead_etcd_member(tmp_path):
    cluster = EtcdCluster(tmp_path, members=3)
    try:
        a, b = elections(cluster, 2)
        for e in (a, b):
            e.start()
        try:
            leader = a if a.is_leader() else b
            # Member 0 is the one every client tries first.  It does not lead the cluster here:
            # a raft leader's death stops every write for etcd's own election (1-3 s here,
            # longer than the key's TTL), which is etcd's outage, not a dead member's.
            cluster.move_leader(1)
            wait_for(lambda: cluster.leader() == 1, 10, what="member e1 leading")
            cluster.kill(0)
            wait_for(lambda: a.is_leader() != b.is_leader()
                     and (a.leader() == b.leader()), 15, what="one agreed leader after a member died")
            held = a if a.is_leader() else b
            # It keeps the key through the refreshes that follow, on the two members left.
            deadline = time.monotonic() + 3 * held.ttl
            while time.monotonic() < deadline:
                assert held.is_leader() and not (a if held is b else b).is_leader()
                time.sleep(0.2)
            assert held is leader or not leader.is_leader()
        finally:
            for e in (a, b):
                e.stop()
    finally:
        cluster.stop()
