"""The in-process recovery's pure parts: who goes on (``decide``), what counts as a lost peer,
and the liveness port that proves a process gone."""

from __future__ import annotations

import socket
import time

import pytest

from rankwatch.hooks.recovery import Decision, RecoveryFailed, _Liveness, _refused, decide, is_peer_failure

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


def test_a_node_that_lost_only_some_workers_goes_to_torchrun():
    d = decide(MEMBERS, _arrived(5), NODE_OF, replica_size=2)
    assert not d.ok and "n2" in d.error and "torchrun" in d.error


def test_a_replica_spanning_nodes_broken_by_a_node_loss_cannot_go_on():
    # Replicas of four ranks span two nodes each: losing n1 breaks the replica 0..3.
    d = decide(MEMBERS, _arrived(2, 3), NODE_OF, replica_size=4)
    assert not d.ok and "replica of ranks 0..3 lost 2 of 4" in d.error


def test_without_replicas_no_node_can_be_lost_in_process():
    d = decide(MEMBERS, _arrived(6, 7), NODE_OF, replica_size=8)
    assert not d.ok and "no survivor holds their shards" in d.error


def test_survivors_at_different_steps_do_not_go_on():
    arrived = _arrived(4, 5)
    arrived[7] = 42  # it applied one more optimizer step than the others
    d = decide(MEMBERS, arrived, NODE_OF, replica_size=2)
    assert not d.ok and "[41, 42]" in d.error


def test_a_replica_size_that_does_not_divide_the_world_is_refused():
    d = decide(MEMBERS, _arrived(4, 5), NODE_OF, replica_size=3)
    assert not d.ok and "does not divide" in d.error


def test_a_decision_crosses_the_store_intact_and_bounded():
    d = Decision(ok=False, error="x" * 10_000)
    back = Decision.from_json(d.to_json(), MEMBERS)
    assert back.ok is False and len(back.error) <= 400
    ok = decide(MEMBERS, _arrived(4, 5), NODE_OF, replica_size=2)
    assert Decision.from_json(ok.to_json(), MEMBERS) == ok


@pytest.mark.parametrize("members, dropped, step, why", [
    ([0, 1, 99], ["n2"], 5, "not unique ranks"),          # a rank not in the world
    ([0, 0, 1], ["n2"], 5, "not unique ranks"),           # a rank twice
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
    live = _Liveness()
    assert not _refused(live.address)
    live.close()  # what the kernel does when the process is gone
    assert _refused(live.address)


def test_an_unreachable_host_proves_nothing():
    # A non-routable address: the connection times out, which is no proof of death.
    assert not _refused("10.255.255.1:9", timeout=0.05)
    assert not _refused("")


def test_many_probes_never_fill_the_liveness_port():
    live = _Liveness()
    port = int(live.address.rpartition(":")[2])
    for _ in range(400):  # a decider probes a live member every few milliseconds, for seconds
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        time.sleep(0.002)
    assert not _refused(live.address)
