"""Coordinator failover: real agents in threads, real gRPC on Unix sockets, a real c10d store.

Coordinator A decides, is stopped, and coordinator B takes over, fed by the same node
agents.  B's decisions continue the job's log: new ids and the next restart generation,
which the nodes apply and the rendezvous handler writes (a reissued id would be dropped
as applied, a reissued generation would restart nobody).
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from conftest import wait_for
from rankwatch.address import Address
from rankwatch.status import fetch_status
from rankwatch.agent.durable.decisions import DecisionLog
from rankwatch.agent.server import Agent, AgentConfig


@pytest.fixture
def job(tmp_path):
    socks = {n: Address(path=str(tmp_path / f"{n}.sock")) for n in ("n0", "n1", "n2", "n3")}
    coordinators = [socks["n0"], socks["n1"]]
    agents = {n: Agent(AgentConfig(node_id=n, listen=[addr], metrics_port=None, coordinators=coordinators,
                                   state_dir=tmp_path / n, sync_interval=0.05))
              for n, addr in socks.items()}
    for a in agents.values():
        a.start()
    yield agents
    for a in agents.values():
        a.stop(timedelta(seconds=0.2))


def _ids(status: dict) -> list[tuple[str, int, str]]:
    return [(d["id"], d["generation"], d["reason"]) for d in status["decisions"]]


def test_a_coordinator_that_takes_over_continues_the_decision_log(job, monkeypatch):
    a, b, n2, n3 = job["n0"], job["n1"], job["n2"], job["n3"]
    wait_for(lambda: a.is_coordinator() and set(a.coordinator.nodes) == set(job), 10,
             what="n0 coordinating every node")
    first = a.coordinator.exclude("n3", "test: first coordinator")
    assert first is not None and first.generation == 1
    for node in (b, n2, n3):
        wait_for(lambda: node.decision_log.get(first.id) is not None, 10, what=f"{first.id} at every node")

    a.stop(timedelta(seconds=0.2))
    wait_for(lambda: b.is_coordinator() and {"n1", "n2", "n3"} <= set(b.coordinator.nodes), 10,
             what="n1 taking over, fed by the node agents")
    assert b.coordinator.excluded == {"n3": "test: first coordinator"}, "the exclusion carries over"
    second = b.coordinator.exclude("n2", "test: second coordinator")
    assert second is not None
    assert second.id != first.id and second.generation == 2

    expected = [(first.id, 1, "test: first coordinator"), (second.id, 2, "test: second coordinator")]
    for node in (b, n2, n3):
        wait_for(lambda: _ids(fetch_status(node.config.listen[0])) == expected, 10,
                 what=f"node {node.config.node_id} applying both decisions")
    assert n2.state.node_id in {d.node for d in n2.decisions() if d.kind == "exclude"}

    # The rendezvous handler writes what the relay reads from a node's status: the second
    # coordinator's exclusion moves the store's generation on.
    from rankwatch.hooks.rendezvous.entry import create_handler
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    monkeypatch.setenv("RANKWATCH_NODE_ID", "n1")
    monkeypatch.delenv("RANKWATCH_AGENT", raising=False)
    handler = create_handler(RendezvousParameters(backend="rankwatch", endpoint="127.0.0.1:0", run_id="job",
                                                  min_nodes=1, max_nodes=3, is_host=True))
    try:
        for d in fetch_status(n3.config.listen[0])["decisions"]:
            handler.write_decision(d)
            assert handler.generation() == d["generation"]
        assert handler._exclusions.node_of(2) == "n2"
    finally:
        handler.shutdown()


def test_decision_ids_carry_the_run_id_and_continue_after_a_restart(tmp_path):
    path = tmp_path / "decisions.jsonl"
    log = DecisionLog(path, run_id="job-7")
    c = log.decide("checkpoint", now=1.0, reason="operator", step=40)
    e = log.decide("exclude", now=2.0, reason="hang", node="n1")
    assert (c.id, c.generation, e.id, e.generation) == ("job-7/checkpoint-1", 0, "job-7/exclude-2", 1)
    again = DecisionLog(path, run_id="job-7")  # the coordinator's agent restarted for the same job
    assert again.items == [], "an earlier run's decisions are not replayed to its nodes"
    nxt = again.decide("exclude", now=3.0, reason="dead", node="n2")
    assert (nxt.id, nxt.generation) == ("job-7/exclude-3", 2)
    assert again.adopt([c, e, nxt]) == [c, e]
    assert again.decide("checkpoint", now=4.0, reason="operator").id == "job-7/checkpoint-4"
