"""The in-process recovery's pure parts: who goes on (``decide``), what counts as a lost peer,
and the liveness port that proves a process gone."""

from __future__ import annotations

import socket
import time

import pytest

from rankwatch.hooks.recovery.inprocess import RecoveryFailed, is_peer_failure
from rankwatch.hooks.recovery.decide import JOINER_BASE, Decision, Joiner, decide
from rankwatch.hooks.recovery.net import Liveness, refused

# Four nodes of two ranks; original ranks 0..7, node i holds ranks 2i and 2i+1.
MEMBERS = tuple(range(8))
NODE_OF = {r: f"n{r // 2}" for r in MEMBERS}


def _arrived(*lost: int, step: int = 41) -> dict[int, int]:
    return {r: step for r in MEMBERS if r not in lost}


def test_a_lost_node_that_held_whole_replicas_is_left_out():
    d = decide(MEMBERS, _arrived(4, 5), NODE_OF, replica_size=2)
    assert d == Decision(ok=True, members=(0, 1, 2, 3, 6, 7), dropped_nodes=("n2",), step=41)


def test_two_lost_nodes_keep_the_survivors_order():
    d = decide(MEMBERS, _arrived(0, 1, 6, 7), NODE_OF, replica_size=2)
    assert d.ok and d.members == (2, 3, 4, 5) and d.dropped_nodes == ("n0", "n3")


def test_nothing_lost_is_not_a_lost_peer():
    d = decide(MEMBERS, _arrived(), NODE_OF, replica_size=2)
    assert not d.ok and "no rank was lost" in d.error


def test_a_node_that_lost_only_some_workers_is_left_out_whole():
    # Rank 5 crashed; its node's torchrun stops rank 4 to restart both: rank 4 is no survivor.
    d = decide(MEMBERS, _arrived(5), NODE_OF, replica_size=2)
    assert d.ok and d.members == (0, 1, 2, 3, 6, 7) and d.dropped_nodes == ("n2",), d
    assert "n2 lost some workers" in d.note


def test_a_node_left_out_whole_still_needs_whole_replicas_elsewhere():
    # Replicas of four ranks: n1 (ranks 2, 3) lost rank 3, so the replica 0..3 loses n1's
    # half and no survivor holds those shards.
    d = decide(MEMBERS, _arrived(3), NODE_OF, replica_size=4)
    assert not d.ok and "replica of ranks 0..3 lost 2 of 4" in d.error


def test_a_survivor_that_failed_inside_a_passed_commit_finishes_the_step():
    # n2 died during step 42's commit: rank 0 got the all-reduce's result and applied step 42,
    # rank 1 failed inside it.  Every rank's part was in, so rank 1's gradients are whole: it
    # applies step 42 too, and no replica is left split between 41 and 42.
    arrived = {0: 42, 1: 41, 2: 42, 3: 41, 6: 42, 7: 41}
    d = decide(MEMBERS, arrived, NODE_OF, replica_size=2, ready=(1, 3, 7))
    assert d.ok and d.step == 42 and d.finish == (1, 3, 7) and d.fresh == (), d
    assert Decision.from_json(d.to_json(), MEMBERS) == d


def test_without_a_passed_commit_nobody_finishes():
    # Nobody completed step 42: the ranks that failed inside its commit stay at 41 with the others.
    arrived = {0: 41, 1: 41, 2: 41, 3: 41, 6: 41, 7: 41}
    d = decide(MEMBERS, arrived, NODE_OF, replica_size=2, ready=(1, 3))
    assert d.ok and d.step == 41 and d.finish == ()
    # A rank behind that failed before the commit (not ready) cannot finish: it takes the state.
    d = decide(MEMBERS, {0: 42, 1: 41, 2: 42, 3: 42, 6: 42, 7: 42}, NODE_OF, replica_size=2)
    assert d.ok and d.step == 42 and d.finish == () and d.fresh == (1,)


def test_a_replica_spanning_nodes_broken_by_a_node_loss_cannot_go_on():
    # Replicas of four ranks span two nodes each: losing n1 breaks the replica 0..3.
    d = decide(MEMBERS, _arrived(2, 3), NODE_OF, replica_size=4)
    assert not d.ok and "replica of ranks 0..3 lost 2 of 4" in d.error


def test_without_replicas_no_node_can_be_lost_in_process():
    d = decide(MEMBERS, _arrived(6, 7), NODE_OF, replica_size=8)
    assert not d.ok and "no survivor holds their shards" in d.error


def test_a_survivor_one_step_ahead_takes_the_state_of_a_whole_replica():
    arrived = _arrived(4, 5)
    arrived[7] = 42  # it applied one more optimizer step than its replica's other rank
    d = decide(MEMBERS, arrived, NODE_OF, replica_size=2)
    assert d.ok and d.step == 41 and d.fresh == (7,) and d.source == 0


def test_the_newest_whole_replica_is_the_source():
    arrived = _arrived(0, 1)
    arrived[6] = arrived[7] = 42  # replica (6, 7) applied step 42 on both ranks; the others did not
    d = decide(MEMBERS, arrived, NODE_OF, replica_size=2)
    # New world (2, 3, 4, 5, 6, 7): replica 2 is the source; the others take its state.
    assert d.ok and d.step == 42 and d.source == 2 and d.fresh == (2, 3, 4, 5)


def test_no_replica_whole_at_one_step_cannot_go_on():
    arrived = {0: 41, 1: 42, 2: 42, 3: 41}   # n2 (ranks 4, 5) lost; each replica left is split
    d = decide((0, 1, 2, 3, 4, 5), arrived, NODE_OF, replica_size=2)
    assert not d.ok and "no replica completed the same step" in d.error


def _joiners(node: str, first: int, world: int, asked: int | None = None) -> list[Joiner]:
    return [Joiner(id=JOINER_BASE + first + i, node=node, local_rank=i, local_world=world)
            for i in range(world if asked is None else asked)]


def test_a_whole_node_of_joiners_is_admitted_after_the_survivors():
    d = decide(MEMBERS[:6], _arrived(6, 7) | {}, NODE_OF, replica_size=2, joiners=_joiners("n9", 1, 2))
    # Nothing lost this time: the survivors left the step to admit n9, which takes replica 0's state.
    assert d.ok and d.members == (0, 1, 2, 3, 4, 5, JOINER_BASE + 1, JOINER_BASE + 2)
    assert d.fresh == (JOINER_BASE + 1, JOINER_BASE + 2) and d.source == 0 and d.step == 41
    assert d.dropped_nodes == ()


def test_joiners_of_a_node_still_asking_wait_for_the_next_boundary():
    d = decide(MEMBERS[:6], _arrived(6, 7), NODE_OF, replica_size=2, joiners=_joiners("n9", 1, 2, asked=1))
    assert not d.ok and "no rank was lost and no node joins" in d.error


def test_joiners_that_do_not_make_whole_replicas_are_turned_away():
    d = decide(MEMBERS, _arrived(6, 7), NODE_OF, replica_size=2, joiners=_joiners("n9", 1, 3))
    assert d.ok and d.members == (0, 1, 2, 3, 4, 5) and "do not make whole replicas" in d.note
    assert d.refused == tuple(JOINER_BASE + i for i in (1, 2, 3))


def test_a_lost_node_and_its_replacement_in_one_decision():
    joiners = list(reversed(_joiners("n9", 1, 2)))   # ask order does not change the rank order
    d = decide(MEMBERS, _arrived(2, 3), NODE_OF, replica_size=2, joiners=joiners)
    assert d.ok and d.members == (0, 1, 4, 5, 6, 7, JOINER_BASE + 1, JOINER_BASE + 2)
    assert d.dropped_nodes == ("n1",)


def test_a_replica_size_that_does_not_divide_the_world_is_refused():
    d = decide(MEMBERS, _arrived(4, 5), NODE_OF, replica_size=3)
    assert not d.ok and "does not divide" in d.error


def test_a_decision_crosses_the_store_intact_and_bounded():
    d = Decision(ok=False, error="x" * 10_000)
    back = Decision.from_json(d.to_json(), MEMBERS)
    assert back.ok is False and len(back.error) <= 400
    ok = decide(MEMBERS, _arrived(4, 5), NODE_OF, replica_size=2)
    assert Decision.from_json(ok.to_json(), MEMBERS) == ok


def test_losing_a_node_that_joined_earlier_crosses_the_store():
    # n9 joined in process before (its workers' ids are joiners'); now it loses a worker.
    members = MEMBERS[:6] + (JOINER_BASE + 1, JOINER_BASE + 2)
    node_of = {**NODE_OF, JOINER_BASE + 1: "n9", JOINER_BASE + 2: "n9"}
    d = decide(members, _arrived(6, 7) | {JOINER_BASE + 2: 41}, node_of, replica_size=2)
    assert d.ok and d.members == MEMBERS[:6] and d.dropped_nodes == ("n9",)
    assert Decision.from_json(d.to_json(), members) == d


@pytest.mark.parametrize("members, dropped, step, why", [
    ([0, 1, 99], ["n2"], 5, "not unique ids"),          # a rank not in the world
    ([0, 0, 1], ["n2"], 5, "not unique ids"),           # a rank twice
    ([0, 1, 2, 3, 4, 5], ["n2", "n3", "n4"], 5, "drops"),  # more nodes dropped than ranks lost
    ([0, 1], ["n" * 65], 5, "drops"),                     # a node name past its cap
    ([0, 1], ["n2"], -1, "step"),
    ([0, 1], ["n2"], 2**63, "step"),
])
def test_a_decision_that_does_not_fit_the_world_is_refused(members, dropped, step, why):
    text = Decision(ok=True, members=tuple(members), dropped_nodes=tuple(dropped), step=step).to_json()
    with pytest.raises(ValueError, match=why):
        Decision.from_json(text, MEMBERS)


def test_an_oversized_decision_is_refused_before_parsing():
    with pytest.raises(ValueError, match="bytes"):
        Decision.from_json('{"members": [' + "0," * 100_000 + '0]}', MEMBERS)


@pytest.mark.parametrize("message", [
    "[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:6018",
    "[../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1: Connection reset by peer",
    "[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 60000ms for recv operation to complete",
])
def test_gloo_peer_failures_are_the_tiers(message):
    assert is_peer_failure(RuntimeError(message))


def test_other_errors_are_not():
    assert not is_peer_failure(ValueError("Connection closed by peer"))
    assert not is_peer_failure(RuntimeError("CUDA out of memory"))
    assert not is_peer_failure(RecoveryFailed("Connection closed by peer"))


def test_a_live_process_accepts_on_its_liveness_port_and_a_gone_one_refuses():
    live = Liveness()
    assert not refused(live.address)
    live.close()  # what the kernel does when the process is gone
    assert refused(live.address)


def test_an_unreachable_host_proves_nothing():
    # A non-routable address: the connection times out, which is no proof of death.
    assert not refused("10.255.255.1:9", timeout=0.05)
    assert not refused("")


def test_many_probes_never_fill_the_liveness_port():
    live = Liveness()
    port = int(live.address.rpartition(":")[2])
    for _ in range(400):  # a decider probes a live member every few milliseconds, for seconds
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        time.sleep(0.002)
    assert not refused(live.address)


def test_a_sigterm_during_the_decision_takes_effect_after_it(tmp_path):
    # The deciding worker's torchrun may stop it while it decides for the others: the decision
    # is written first, then the SIGTERM ends the process as it would have.
    import subprocess
    import sys

    done = tmp_path / "decision"
    code = ("import os, signal, sys\n"
            "from rankwatch.hooks.recovery.net import deferred_termination\n"
            "with deferred_termination():\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            f"    open({str(done)!r}, 'w').write('written')\n"
            "print('after the block', flush=True)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.read_text() == "written"
    assert out.returncode == -15 and "after the block" not in out.stdout, (out.returncode, out.stdout, out.stderr)
