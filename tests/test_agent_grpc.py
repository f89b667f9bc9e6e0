"""A real agent (in a thread, real gRPC on a Unix socket) and the real rank client."""

from __future__ import annotations

import os
import stat
import time
from datetime import timedelta

import pytest

from prometheus_client import generate_latest

from conftest import parse_metrics, wait_for
from rankwatch.address import Address
from rankwatch.agent.server import Agent, AgentConfig
from rankwatch.hooks.instrument.client import AgentClient
from rankwatch.hooks.instrument.recorder import OPS, Recorder
from rankwatch.proto import pb
from rankwatch.status import AgentUnreachable, fetch_status


@pytest.fixture
def agent(tmp_path):
    a = Agent(AgentConfig(node_id="n0", listen=[Address(path=str(tmp_path / "a.sock"))],
                          metrics_port=0, metrics_addr="127.0.0.1"))
    a.start()
    yield a
    a.stop(timedelta(seconds=0.5))


def make_client(addr, rank=0, world=2, pid=None, **kw):
    rec = Recorder(capacity=kw.pop("capacity", 1 << 17))
    hello = pb.Hello(rank=rank, world_size=world, pid=pid or os.getpid(), node_id="n0",
                     backend="gloo", op_names=list(OPS))
    client = AgentClient(rec, hello, addr, flush_interval=timedelta(milliseconds=20), **kw)
    return rec, client


def feed(rec: Recorder, n: int, op: int = 0) -> None:
    t = time.perf_counter_ns()
    for i in range(n):
        rec.collective(op, 0, i, t, t + 1000, 128)


def test_records_reach_agent_and_status(agent):
    addr = agent.config.listen[0]
    rec, client = make_client(addr)
    client.start()
    try:
        feed(rec, 5000, op=1)
        with rec.step_scope(1, tokens=64):
            rec.mark("data")
            rec.mark("forward")
        wait_for(lambda: agent.state.records["collective"] == 5000 and agent.state.records["step"] == 1,
                 10, what="records at the agent")
        status = fetch_status(addr)
        (r,) = status["ranks"]
        assert {"rank", "node", "pid", "step", "step_seconds", "state"} <= r.keys()
        assert r["rank"] == 0 and r["pid"] == os.getpid() and r["step"] == 1 and r["state"] == "ok"
        assert r["collectives"] == 5000
        assert status["incidents"] == []
    finally:
        client.close()
    wait_for(lambda: not agent.state.ranks[0].connected, 5, what="clean goodbye")
    assert agent.state.ranks[0].state == "ok"


def test_close_ends_every_client_thread(agent):
    """The command stream waits for the agent's next command; close() cancels it, so no
    thread of the client is left inside a gRPC call when the interpreter finalises (that
    aborted a worker after training: "terminate called without an active exception")."""
    import threading

    rec, client = make_client(agent.config.listen[0])
    before = set(threading.enumerate())
    client.start()
    wait_for(lambda: 0 in agent.state.ranks, 10, what="the rank's hello")
    mine = [t for t in set(threading.enumerate()) - before
            if t.name in ("rankwatch-flusher", "rankwatch-sender", "rankwatch-commands")]
    assert len(mine) == 3, mine
    client.close()
    assert [t.name for t in mine if t.is_alive()] == []
    wait_for(lambda: not agent.state.ranks[0].connected, 5, what="the goodbye")
    assert agent.state.ranks[0].exited_cleanly


_NEVER_CLOSED = """
import sys, time
sys.path.insert(0, sys.argv[2])
from test_agent_grpc import make_client
from rankwatch.address import Address
rec, client = make_client(Address(path=sys.argv[1]))
client.start()
client.connected.wait(10)
with rec.step_scope(1):
    pass
"""


def test_a_client_never_closed_says_goodbye_at_exit(agent, tmp_path):
    """A user's script that never closes its monitor: the client closes itself at the
    interpreter's exit, with a goodbye, and the process exits 0."""
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "never_closed.py"
    script.write_text(_NEVER_CLOSED)
    done = subprocess.run([sys.executable, str(script), agent.config.listen[0].path, str(Path(__file__).parent)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    wait_for(lambda: agent.state.ranks.get(0) is not None and not agent.state.ranks[0].connected, 10,
             what="the stream closed")
    assert agent.state.ranks[0].exited_cleanly, done.stderr
    assert agent.state.records["step"] == 1


def test_socket_is_private(agent):
    mode = stat.S_IMODE(os.stat(agent.config.listen[0].path).st_mode)
    assert mode == 0o600


def test_second_agent_on_same_socket_refused(agent):
    other = Agent(AgentConfig(node_id="n1", listen=agent.config.listen, metrics_port=None))
    with pytest.raises(RuntimeError, match="already listening"):
        other.start()


def test_no_agent_then_agent_arrives_reports_drops(tmp_path):
    addr = Address(path=str(tmp_path / "late.sock"))
    rec, client = make_client(addr, queue_batches=2, max_batch=100)
    client.start()
    try:
        t0 = time.perf_counter()
        feed(rec, 2000)  # nobody listening: the training side must not notice
        assert time.perf_counter() - t0 < 0.5
        wait_for(lambda: client.dropped_total > 0, 5, what="drops while away")
        late = Agent(AgentConfig(node_id="n0", listen=[addr], metrics_port=None))
        late.start()
        try:
            wait_for(lambda: 0 in late.state.ranks, 10, what="reconnect")
            feed(rec, 10)
            # Every record is either delivered or counted as dropped, and the agent knows the count.
            wait_for(lambda: late.state.records["collective"] + late.state.ranks[0].dropped == 2010,
                     10, what="delivered + dropped == issued")
            assert late.state.ranks[0].dropped == client.dropped_total > 0
        finally:
            late.stop(timedelta(seconds=0.2))
    finally:
        client.close(timedelta(seconds=0.2))


def test_batches_are_queued_in_the_order_of_their_numbers(tmp_path, monkeypatch):
    # close() flushes from the training thread while the flusher thread may be flushing too;
    # the agent refuses a batch numbered below one it already has.  Building a batch is made
    # slow here so that two flushes overlap.
    import threading

    rec, client = make_client(Address(path=str(tmp_path / "none.sock")))
    build = client._build_batch

    def slow_build():
        batch, n = build()
        time.sleep(0.002)
        return batch, n
    monkeypatch.setattr(client, "_build_batch", slow_build)
    threads = [threading.Thread(target=lambda: [client._flush_once(force=True) for _ in range(20)])
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seqs = []
    while not client._queue.empty():
        seqs.append(client._queue.get_nowait().seq)
    assert len(seqs) == 40 and seqs == sorted(seqs), seqs
    client.close(timedelta(seconds=0.2))


def test_deque_overflow_is_counted(tmp_path):
    addr = Address(path=str(tmp_path / "none.sock"))
    rec, client = make_client(addr, capacity=100)
    feed(rec, 1000)  # 900 discarded by the bounded deque before any drain
    client.close(timedelta(seconds=0.2))  # flushes once: the drain finds the overflow
    assert client.dropped_total == 900


def test_duplicate_rank_refused_first_keeps_streaming(agent):
    addr = agent.config.listen[0]
    rec1, c1 = make_client(addr, rank=1)
    c1.start()
    try:
        wait_for(lambda: 1 in agent.state.ranks, 5)
        rec2, c2 = make_client(addr, rank=1, pid=os.getppid())  # a different, live process
        c2.start()
        # Its nonce shows the agent (SO_PEERCRED) that the claimed pid is not the caller's.
        wait_for(lambda: agent.state.rejected.get("pid_not_peer", 0) >= 1, 5, what="refusal")
        c2.close(timedelta(seconds=0.2))
        feed(rec1, 50)
        wait_for(lambda: agent.state.ranks[1].collective_counts.sum() == 50, 5)
        assert agent.state.ranks[1].pid == os.getpid()
    finally:
        c1.close()


def test_status_without_agent_is_clear_error(tmp_path):
    with pytest.raises(AgentUnreachable, match="no agent at"):
        fetch_status(Address(path=str(tmp_path / "nobody.sock")), timedelta(milliseconds=300))


def test_stop_removes_socket(tmp_path):
    path = tmp_path / "s.sock"
    a = Agent(AgentConfig(node_id="n0", listen=[Address(path=str(path))], metrics_port=0,
                          metrics_addr="127.0.0.1"))
    a.start()
    assert path.exists()
    a.stop(timedelta(seconds=0.1))
    assert not path.exists() and a.wait(timedelta(seconds=1))


def test_a_job_straggler_verdict_marks_the_rank_until_the_coordinator_resolves_it(agent):
    import json
    rec, client = make_client(agent.config.listen[0], rank=1)
    client.start()
    try:
        wait_for(lambda: 1 in agent.state.ranks, 10, what="rank 1 connected")
        flagged = pb.Incident(id="straggler-1", kind="straggler", node="n0", rank=1, step=50,
                              detected_at=time.time(),
                              detail_json=json.dumps({"cause": "compute", "slowdown": 1.4, "ranks": [1],
                                                      "cost": {"speedup_if_removed": 1.3}}))
        agent.on_job_incident("n9", flagged)
        assert agent.state.ranks[1].state == "straggler"
        agent.watch.check_stragglers(time.time())  # the node's own detector (one rank) keeps the mark
        agent.on_job_incident("n9", flagged)  # the same verdict, synced again
        assert agent.state.ranks[1].state == "straggler"
        # Exported by the rank's own node (no other agent exports the rank), with its cause.
        flag = ("rankwatch_rank_straggler", frozenset({("node", "n0"), ("rank", "1"), ("cause", "compute")}))
        cost = ("rankwatch_straggler_cost_ratio", frozenset({("node", "n0")}))
        m = parse_metrics(generate_latest(agent.registry).decode())
        assert m.get(flag) == 1.0 and m[cost] == 1.3
        resolved = pb.Incident()
        resolved.CopyFrom(flagged)
        resolved.detail_json = json.dumps({"cause": "compute", "slowdown": 1.4, "ranks": [1],
                                           "resolved_at": time.time()})
        agent.on_job_incident("n9", resolved)
        assert agent.state.ranks[1].state == "ok"
        m = parse_metrics(generate_latest(agent.registry).decode())
        assert flag not in m and m[cost] == 1.0
        (kept,) = [i for i in agent.incidents.items if i.id == "n9/straggler-1"]
        assert "resolved_at" in kept.detail
    finally:
        client.close()
