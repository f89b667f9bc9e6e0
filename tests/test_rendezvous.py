"""The ``rankwatch`` rendezvous handler over a real c10d rendezvous (TCPStore, stock dynamic handler).

Two "nodes" join one round from two threads of this process; the coordinator's
decisions are written into the store exactly as the relay writes them.  The test
hosts the rendezvous store itself, on a port the system picked, and every node is
its client.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import RendezvousGracefulExitError, RendezvousParameters

from rankwatch.hooks.recovery.store import (
    ATTEMPTS_COUNT,
    CAPABLE_KEY,
    DECIDED_COUNT,
    JOIN_ENV,
    RESTARTING_KEY,
    ROUND_ENV,
    STANDBY_ENV,
    STORE_ENV,
    Seal,
    mark_regrouped,
)
from rankwatch.address import Address
from rankwatch.hooks.rendezvous.poller import DecisionRelay
from rankwatch.hooks.rendezvous.entry import create_handler


@pytest.fixture
def port():
    """The rendezvous store's port: a store this test hosts on port 0."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                     timeout=timedelta(seconds=60))
    yield store.port
    del store


def _handlers(nodes, monkeypatch, port, max_nodes=3):
    made = []
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # as `rankwatch run` sets it
    for node in nodes:
        monkeypatch.setenv("RANKWATCH_NODE_ID", node)
        monkeypatch.delenv("RANKWATCH_AGENT", raising=False)  # no relay: decisions are written here
        params = RendezvousParameters(
            backend="rankwatch", endpoint=f"127.0.0.1:{port}", run_id="job", min_nodes=2, max_nodes=max_nodes,
            is_host=False, last_call_timeout=1, join_timeout=30, keep_alive_interval=1)
        made.append(create_handler(params))
    return made


def _join(handlers):
    infos = [None] * len(handlers)
    errors = []

    def join(i):
        try:
            infos[i] = handlers[i].next_rendezvous()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=join, args=(i,)) for i in range(len(handlers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return infos


def _decision(node, generation):
    return {"kind": "exclude", "id": f"exclude-{generation}", "node": node, "generation": generation,
            "reason": f"test: {node} excluded"}


def _survivors_at_exit_barrier(infos):
    """n0's and n1's torchruns at their round's exit barrier, as torchrun's agent waits there
    once its workers succeeded: (the threads, the ranks that left it, a function reading how
    many checked in, on n2's client, which nobody blocks)."""
    from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID
    from torch.distributed.elastic.utils import store as store_util

    count_key = _TERMINAL_STATE_SYNC_ID + store_util._NUM_MEMBERS
    arrived = []

    def exit_barrier(info):
        store_util.barrier(info.store, info.world_size, _TERMINAL_STATE_SYNC_ID, barrier_timeout=60)
        arrived.append(info.rank)

    threads = [threading.Thread(target=exit_barrier, args=(info,), daemon=True) for info in infos[:2]]
    for t in threads:
        t.start()

    def checked_in():
        return infos[2].store.add(count_key, 0)

    deadline = time.monotonic() + 30
    while checked_in() < 2:
        assert time.monotonic() < deadline, "n0 and n1 did not reach the exit barrier"
        time.sleep(0.02)
    return threads, arrived, checked_in


def test_only_an_exclusion_of_a_round_member_restarts_it(monkeypatch, port):
    a, b = _handlers(["n0", "n1"], monkeypatch, port)
    try:
        infos = _join([a, b])
        assert sorted(i.world_size for i in infos) == [2, 2]
        assert a.num_nodes_waiting() == 0 and b.num_nodes_waiting() == 0
        # A node that is not in this round (dead before it formed) is excluded: nothing restarts.
        a.write_decision(_decision("n2", 1))
        assert a.generation() == 1
        assert a.num_nodes_waiting() == 0 and b.num_nodes_waiting() == 0
        # A member is excluded: both restart, and the excluded one is refused on the next join.
        a.write_decision(_decision("n1", 2))
        assert a.num_nodes_waiting() > 0 and b.num_nodes_waiting() > 0
        with pytest.raises(RendezvousGracefulExitError, match="n1 is excluded"):
            b.next_rendezvous()
        # Writing the same decision again (every relay retries) changes nothing.
        a.write_decision(_decision("n1", 2))
        assert a.generation() == 2
    finally:
        for h in (b, a):
            h.shutdown()


def test_an_exclusion_after_the_workers_finished_does_not_hold_the_others_at_torchruns_exit_barrier(
        monkeypatch, port):
    # A fatal XID in the job's last step: n2 is excluded once n0's and n1's workers have
    # finished.  Its torchrun leaves and never checks in at the round's exit barrier, and no
    # restart or regroup comes, so n0 and n1 would wait there for torchrun's 300 s.
    a, b, c = _handlers(["n0", "n1", "n2"], monkeypatch, port)
    try:
        infos = _join([a, b, c])
        assert sorted(i.world_size for i in infos) == [3, 3, 3]
        threads, arrived, checked_in = _survivors_at_exit_barrier(infos)
        assert c.stand_in_for_excluded("n2") is False, "a node never stands in for itself"
        # The coordinator's relay (n0's, whose torchrun waits at the barrier on the same store
        # client) writes the exclusions, and stands in for an excluded member of its round; it
        # does nothing for a node that is not a member.
        relay = DecisionRelay(a, Address.parse("127.0.0.1:1"), 0.25)   # never started: no polls
        relay._apply({"coordinator": True, "decisions": [_decision("n9", 1)], "ranks": []})
        assert checked_in() == 2
        applied = threading.Thread(target=relay._apply, daemon=True, args=(
            {"coordinator": True, "decisions": [_decision("n9", 1), _decision("n2", 2)], "ranks": []},))
        applied.start()
        for t in (*threads, applied):
            t.join(30)
        assert sorted(arrived) == sorted(i.rank for i in infos[:2]), "the survivors left the barrier"
        # Counted once, however often it is asked (a new coordinator writes the decisions again).
        assert a.stand_in_for_excluded("n2") is False and b.stand_in_for_excluded("n2") is False
        assert checked_in() == 3
    finally:
        for h in (c, b, a):
            h.shutdown()


def test_an_excluded_node_whose_agent_coordinates_checks_in_at_the_exit_barrier_as_it_leaves(
        monkeypatch, port):
    # The same fatal XID in the last step, on n2, whose agent is the coordinator: its relay
    # writes its own exclusion and cannot stand in for it (its torchrun might be at the
    # barrier itself).  Its torchrun is not: its workers are killed, and it asks for the next
    # round, which refuses it.  As it leaves, it checks in for itself, once.
    a, b, c = _handlers(["n0", "n1", "n2"], monkeypatch, port)
    try:
        infos = _join([a, b, c])
        threads, arrived, checked_in = _survivors_at_exit_barrier(infos)
        DecisionRelay(c, Address.parse("127.0.0.1:1"), 0.25)._apply(
            {"coordinator": True, "decisions": [_decision("n2", 1)], "ranks": []})
        assert checked_in() == 2, "the relay does not stand in for its own node"
        with pytest.raises(RendezvousGracefulExitError, match="n2 is excluded"):
            c.next_rendezvous()
        for t in threads:
            t.join(30)
        assert sorted(arrived) == sorted(i.rank for i in infos[:2]), "the survivors left the barrier"
        with pytest.raises(RendezvousGracefulExitError):
            c.next_rendezvous()
        assert a.stand_in_for_excluded("n2") is False   # a new coordinator's relay: counted once
        assert checked_in() == 3
    finally:
        for h in (c, b, a):
            h.shutdown()


def test_a_spare_waits_without_restarting_the_job_then_takes_an_excluded_nodes_place(monkeypatch, port):
    # The hand-over through the rankwatch handler.  (The stock handler parks this spare in its
    # redundancy list too; the restart storm of a spare stranded in the wait list needs
    # startup races that tests/test_e2e_restart.py's four-node test reproduces.)
    a, b, spare = _handlers(["n0", "n1", "n2"], monkeypatch, port, max_nodes=2)
    try:
        _join([a, b])
        joined = []
        t = threading.Thread(target=lambda: joined.append(spare.next_rendezvous()), daemon=True)
        t.start()
        t.join(3)
        assert t.is_alive(), "the spare waits while the job is full"
        assert a.num_nodes_waiting() == 0 and b.num_nodes_waiting() == 0, "no restart for a spare"
        a.write_decision(_decision("n1", 1))
        assert a.num_nodes_waiting() > 0
        with pytest.raises(RendezvousGracefulExitError):
            b.next_rendezvous()
        info = a.next_rendezvous()  # a restarts; the spare takes n1's place
        t.join(30)
        assert joined and info.world_size == 2 and joined[0].world_size == 2
        assert {info.rank, joined[0].rank} == {0, 1}
    finally:
        for h in (spare, b, a):
            h.shutdown()


def test_a_spare_of_a_full_round_that_recovers_in_process_stands_by_and_a_second_waits(monkeypatch, port):
    # The first spare's workers start at once, as a standby for the next lost node's place
    # (the survivors admit them at that loss, in process): nobody restarts for it.  The
    # second finds that place claimed and waits as a hot spare, outside the stock
    # rendezvous, which would restart every node's workers to admit it.
    for name in (STORE_ENV, ROUND_ENV, JOIN_ENV, STANDBY_ENV):
        monkeypatch.delenv(name, raising=False)  # the handlers export them to their workers
    a, b, spare, second = _handlers(["n0", "n1", "n2", "n3"], monkeypatch, port, max_nodes=2)
    workers = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    try:
        _join([a, b])
        prefix = os.environ[ROUND_ENV]
        assert STANDBY_ENV not in os.environ   # a round's own nodes do not stand by
        workers.set(prefix + CAPABLE_KEY, "1")  # the round's workers recover in process
        info = spare.next_rendezvous()
        assert info.world_size == 1 and os.environ[JOIN_ENV] == "1" and os.environ[STANDBY_ENV] == "1"
        assert os.environ[ROUND_ENV] == prefix
        assert a.num_nodes_waiting() == 0 and b.num_nodes_waiting() == 0, "no node restarts for the standby"
        waiting = threading.Thread(target=second.next_rendezvous, daemon=True)
        waiting.start()
        waiting.join(3)
        assert waiting.is_alive(), "the second spare waits while the job is full"
        assert a.num_nodes_waiting() == 0 and b.num_nodes_waiting() == 0
    finally:
        for h in (second, spare, b, a):
            h.shutdown()


def _capable_round(monkeypatch, port):
    """Nodes n0 and n1 in one round whose workers recover in process: their handlers, a
    client of the store as the workers hold it, and the round's key prefix."""
    for name in (STORE_ENV, ROUND_ENV, JOIN_ENV):
        monkeypatch.delenv(name, raising=False)  # the handlers export them to their workers
    a, b = _handlers(["n0", "n1"], monkeypatch, port)
    workers = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    _join([a, b])
    prefix = os.environ[ROUND_ENV]
    workers.set(prefix + CAPABLE_KEY, "1")
    return a, b, workers, prefix


def _restart_workers(handler):
    """``handler``'s torchrun restarts its workers (one failed): it rendezvous again, from a thread."""
    got: list = []
    t = threading.Thread(target=lambda: got.append(handler.next_rendezvous()), daemon=True)
    t.start()
    return t, got


def test_a_node_restarting_its_workers_rejoins_in_process_once_the_others_leave_it_out(monkeypatch, port):
    # One of n1's workers died; n1's torchrun restarts its workers.  The other nodes' workers
    # are agreeing to leave n1 out in process: n1 waits for them (past the grace for an idle
    # round), then joins in process, and no node restarts its workers for it.
    a, b, workers, prefix = _capable_round(monkeypatch, port)
    try:
        workers.add(prefix + ATTEMPTS_COUNT, 1)   # n0's workers began to agree
        t, joined = _restart_workers(b)
        t.join(2.5)
        assert t.is_alive(), "n1 waits while the others agree"
        assert a.num_nodes_waiting() == 0, "n1 did not enter the stock rendezvous"
        mark_regrouped(workers, prefix, "n1", 1, Seal(None))
        workers.add(prefix + DECIDED_COUNT, 1)
        t.join(30)
        assert joined and joined[0].world_size == 1 and os.environ[JOIN_ENV] == "1", "its workers join in process"
        assert a.num_nodes_waiting() == 0, "no node restarts its workers for n1"
    finally:
        for h in (b, a):
            h.shutdown()


def test_a_node_restarting_its_workers_in_an_idle_round_restarts_the_round_at_once(monkeypatch, port):
    # No worker of the round is agreeing on anything (every worker failed alike): after the
    # short grace, n1 rendezvous as the stock handler does, and n0 sees it waiting.
    a, b, _, _ = _capable_round(monkeypatch, port)
    try:
        t0 = time.monotonic()
        t, rejoined = _restart_workers(b)
        while a.num_nodes_waiting() == 0:
            assert time.monotonic() - t0 < 4.0, "n1 held the restart for the in-process wait's full 5 s"
            time.sleep(0.05)
        (info,) = _join([a])   # n0's torchrun restarts its workers with it
        t.join(30)
        assert rejoined and rejoined[0].world_size == info.world_size == 2
    finally:
        for h in (b, a):
            h.shutdown()


def test_a_store_that_stops_answering_is_no_node_waiting_not_an_error(monkeypatch, caplog):
    # torchrun's agent asks num_nodes_waiting() between its worker checks; an exception there
    # ends torchrun and the job (an etcd member's loss did that while etcd elected a leader).
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    a, b = _handlers(["n0", "n1"], monkeypatch, store.port)
    _join([a, b])
    a.write_decision(_decision("n1", 1))
    assert a.num_nodes_waiting() > 0   # the store answers: a member was excluded
    del store                          # the store's server goes away
    assert a.num_nodes_waiting() == 0
    assert "the rendezvous store did not answer" in caplog.text


def test_a_node_that_joined_in_process_restarts_with_its_round_once(monkeypatch, port):
    # n1's workers joined the round in process; then the round gives up on recovering in
    # process (a failed decision marks it restarting) and every torchrun restarts its
    # workers into a new stock round.  There n1 is a member like any other: the old round's
    # mark must not make it restart its workers again at every check (it did, forever).
    a, b, workers, prefix = _capable_round(monkeypatch, port)
    try:
        workers.add(prefix + ATTEMPTS_COUNT, 1)
        t, joined = _restart_workers(b)
        mark_regrouped(workers, prefix, "n1", 1, Seal(None))
        workers.add(prefix + DECIDED_COUNT, 1)
        t.join(30)
        assert joined and os.environ[JOIN_ENV] == "1", "n1's workers joined in process"
        workers.set(prefix + RESTARTING_KEY, "n0")   # the decision failed: torchrun restarts the round
        assert b.num_nodes_waiting() == 1 and a.num_nodes_waiting() == 1
        infos = _join([a, b])
        assert [i.world_size for i in infos] == [2, 2] and JOIN_ENV not in os.environ
        assert a.num_nodes_waiting() == 0 and b.num_nodes_waiting() == 0, "the new round trains on"
    finally:
        for h in (b, a):
            h.shutdown()
