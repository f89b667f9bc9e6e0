"""One agent per node id, one node per rank id: the coordinator's claim rules (agent/job/claims.py).

Synthetic summaries into a real :class:`Coordinator` on a test clock; the e2e test
(test_claims_e2e.py) sends a hostile peer's over real gRPC.
"""

from __future__ import annotations

import pytest

from rankwatch.agent.durable.incidents import IncidentLog
from rankwatch.agent.job import claims
from rankwatch.agent.job.coordinator import Coordinator, PolicyConfig
from rankwatch.agent.wire.ranges import Rejected
from rankwatch.proto import pb


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def summary(node: str, seq: int, now: float, ranks: list[int], instance: str = "", **rank_fields) -> pb.NodeSummary:
    s = pb.NodeSummary(node_id=node, seq=seq, sent_at=now, agent_instance=instance)
    for r in ranks:
        s.ranks.append(pb.RankSummary(**{"rank": r, "pid": 1000 + r, "connected": True, "alive": True,
                                         "steps_completed": 10, "step": 10, "step_seconds": 0.1,
                                         "activity": "train", "progress_at": now, "last_seen": now,
                                         **rank_fields}))
    return s


@pytest.fixture
def coord():
    clock = Clock()
    return Coordinator("n0", incidents=IncidentLog(None), policy=PolicyConfig(), clock=clock), clock


def ranks_of(c: Coordinator) -> list[tuple[str, int]]:
    return sorted((node, r.rank) for node, r, _ in c.rank_summaries())


def test_a_rank_held_by_a_live_node_is_refused_to_a_second_one(coord):
    c, clock = coord
    c.sync(summary("a", 1, clock.t, [0, 1], "ia"))
    refusals: list[ValueError] = []
    c.sync(summary("ghost", 1, clock.t, [1, 5], "ig", state="hung"), refusals.append)
    assert ranks_of(c) == [("a", 0), ("a", 1), ("ghost", 5)]   # never a second rank 1; ghost's rank 5 is kept
    assert [e.reason for e in refusals] == ["rank_conflict"]
    assert [(k.rank, k.holder, k.claimant) for k in c.rank_conflicts(clock.t)] == [(1, "a", "ghost")]
    clock.t += 0.25
    c.sync(summary("a", 2, clock.t, [0, 1], "ia"))   # the holder keeps it while it syncs
    c.sync(summary("ghost", 2, clock.t, [1, 5], "ig"), refusals.append)
    assert ranks_of(c) == [("a", 0), ("a", 1), ("ghost", 5)]
    [held] = c.rank_conflicts(clock.t)
    assert (held.refused, held.since) == (2, 1000.0)


def test_the_claim_lapses_when_its_holder_stops_syncing(coord):
    c, clock = coord
    c.sync(summary("a", 1, clock.t, [1], "ia"))
    c.sync(summary("b", 1, clock.t, [1], "ib"))
    assert ranks_of(c) == [("a", 1)]
    clock.t += claims.HOLD_FLOOR_SECONDS - 0.1   # a missed sync or two: still a's
    c.sync(summary("b", 2, clock.t, [1], "ib"))
    assert ranks_of(c) == [("a", 1)]
    clock.t += 0.2   # a silent past its hold (long before it is dead)
    c.sync(summary("b", 3, clock.t, [1], "ib"))
    assert ranks_of(c) == [("a", 1), ("b", 1)]   # a's stale copy stays listed, b holds the id
    assert c.rank_conflicts(clock.t) == []
    assert c.view.claims.holders[1] == "b"
    refusals: list[ValueError] = []
    c.sync(summary("a", 2, clock.t, [1], "ia"), refusals.append)   # a comes back: now it is the second claim
    assert [e.reason for e in refusals] == ["rank_conflict"]
    assert [(k.holder, k.claimant) for k in c.rank_conflicts(clock.t)] == [("b", "a")]


def test_a_rank_that_moved_in_a_restart_conflicts_only_until_its_old_node_lets_go(coord):
    c, clock = coord
    c.sync(summary("a", 1, clock.t, [0, 1], "ia"))
    c.sync(summary("b", 1, clock.t, [2, 3], "ib"))
    clock.t += 0.25   # the restart gave a's rank 1 to b: b's agent hears it first
    c.sync(summary("b", 2, clock.t, [1, 3], "ib"))
    assert [(k.rank, k.claimant) for k in c.rank_conflicts(clock.t)] == [(1, "b")]
    c.sync(summary("a", 2, clock.t, [0, 2], "ia"))   # a's old rank 1 ended; it now runs rank 2
    clock.t += 0.25
    c.sync(summary("b", 3, clock.t, [1, 3], "ib"))
    assert ranks_of(c) == [("a", 0), ("a", 2), ("b", 1), ("b", 3)]
    assert c.rank_conflicts(clock.t) == []


def test_a_rank_that_ended_cleanly_claims_nothing_and_an_excluded_holder_lets_go(coord):
    c, clock = coord
    c.sync(summary("a", 1, clock.t, [0], "ia", exited_cleanly=True))
    c.sync(summary("b", 1, clock.t, [0], "ib"))
    assert c.rank_conflicts(clock.t) == [] and c.view.claims.holders[0] == "b"
    c.sync(summary("c", 1, clock.t, [0], "ic"))
    assert [k.claimant for k in c.rank_conflicts(clock.t)] == ["c"]
    c.log.decide("exclude", now=clock.t, reason="test", node="b")
    c.sync(summary("c", 2, clock.t, [0], "ic"))
    assert c.view.claims.holders[0] == "c" and c.rank_conflicts(clock.t) == []


def test_a_live_agents_node_id_cannot_be_taken_over(coord):
    c, clock = coord
    c.sync(summary("a", 5, clock.t, [0], "ia"))
    for instance in ("other", ""):   # another instance, or a summary that names none
        with pytest.raises(Rejected, match="node_taken"):
            c.sync(summary("a", 10**6, clock.t + 0.1, [0], instance, state="hung"))
    [(node, rank)] = [(n, r) for n, r, _ in c.rank_summaries()]
    assert node == "a" and rank.state != "hung" and c.view.nodes["a"].seq == 5
    clock.t += claims.HOLD_FLOOR_SECONDS + 0.1   # the agent restarted: the old instance has gone quiet
    c.sync(summary("a", 1, clock.t, [0], "ia-restarted"))
    assert c.view.nodes["a"].instance == "ia-restarted"
    with pytest.raises(Rejected, match="node_taken"):
        c.sync(summary("a", 7, clock.t + 0.1, [0], "ia"))


def test_an_agent_that_sends_no_instance_leaves_its_node_id_open(coord):
    c, clock = coord
    c.sync(summary("a", 1, clock.t, [0]))
    c.sync(summary("a", 2, clock.t + 0.1, [0], "later"))   # an older agent holds nothing
    assert c.view.nodes["a"].instance == "later"


def test_the_hold_grows_with_the_interval_nodes_are_told_to_sync_at():
    assert claims.holding(10.0, 10.0 - claims.HOLD_FLOOR_SECONDS, 0.05)
    assert not claims.holding(10.0, 10.0 - claims.HOLD_FLOOR_SECONDS - 0.01, 0.05)
    assert claims.holding(10.0, 10.0 - 3.9 * 2.0, 2.0)   # an overloaded coordinator's slow syncs
    assert not claims.holding(10.0, 10.0 - 4.1 * 2.0, 2.0)


def test_conflicts_kept_are_bounded(coord, monkeypatch):
    monkeypatch.setattr(claims, "MAX_CONFLICTS", 8)
    c, clock = coord
    c.sync(summary("a", 1, clock.t, list(range(32)), "ia"))
    for i in range(4):
        c.sync(summary(f"g{i}", 1, clock.t, list(range(32)), f"g{i}"))
    assert len(c.view.claims.conflicts) == 8
    assert ranks_of(c) == [("a", r) for r in range(32)]
