"""Peer snapshots' pure parts: the buddy map (which node holds whose copy), the decision from
the snapshots the survivors hold, and its way through the store's JSON; and, in one real
gloo process, a snapshot of an FSDP2 job put back into a job built anew."""

from __future__ import annotations

import itertools

import pytest

from rankwatch.hooks.recovery.buddies import buddy_map, covered_by, sources_of
from rankwatch.hooks.recovery.decide import (JOINER_BASE, Decision, Joiner, Membership, from_checkpoint,
                                             from_snapshots)


def _nodes(n: int, per: int) -> list[str]:
    return [f"n{r // per}" for r in range(n * per)]


@pytest.mark.parametrize("nodes,per", [(2, 1), (3, 1), (3, 2), (4, 2), (5, 3)])
def test_every_rank_s_buddy_is_on_another_node_and_holds_one_copy(nodes, per):
    node_of = _nodes(nodes, per)
    b = buddy_map(node_of)
    assert all(node_of[r] != node_of[b[r]] for r in range(len(b)))
    assert sorted(b) == list(range(len(b)))   # a permutation: each rank holds one copy (2x memory)
    assert all(sources_of(b, r) == [q for q in range(len(b)) if b[q] == r] for r in range(len(b)))


@pytest.mark.parametrize("nodes,per", [(2, 2), (3, 1), (4, 2), (6, 1)])
def test_losing_any_one_node_leaves_every_shard_somewhere(nodes, per):
    node_of = _nodes(nodes, per)
    for lost in set(node_of):
        assert covered_by(node_of, {lost}) == list(range(len(node_of))), lost


def test_two_nodes_lost_cost_a_node_s_shards_only_when_they_are_ring_neighbours():
    node_of = _nodes(5, 2)
    for a, b in itertools.combinations(sorted(set(node_of)), 2):
        gone = set(range(len(node_of))) - set(covered_by(node_of, {a, b}))
        i, j = int(a[1:]), int(b[1:])
        neighbours = (j - i) % 5 in (1, 4)
        assert bool(gone) is neighbours, (a, b, gone)
        if neighbours:   # the earlier node's shards in the ring: its buddies are on the later one
            first = a if (j - i) % 5 == 1 else b
            assert gone == {r for r, n in enumerate(node_of) if n == first}


def test_uneven_nodes_still_hold_every_copy_off_their_own_node():
    node_of = ["a", "a", "a", "b", "c", "c"]
    b = buddy_map(node_of)
    assert all(node_of[r] != node_of[b[r]] for r in range(6))
    for lost in "abc":
        assert covered_by(node_of, {lost}) == list(range(6))


def test_one_node_holds_no_copies():
    assert buddy_map(["a", "a"]) == [0, 1] and sources_of([0, 1], 0) == []


# Three nodes of one rank; buddies 0 -> 1 -> 2 -> 0.
MEMBERS = (0, 1, 2)
NODE_OF = {0: "n0", 1: "n1", 2: "n2"}


def test_a_lost_node_s_shards_come_from_its_buddy_at_the_newest_common_step():
    arrived = {0: 23, 2: 23}
    holdings = {0: {"own": 20, "held": {2: 20}}, 2: {"own": 20, "held": {1: 20}}}
    d = from_snapshots(MEMBERS, arrived, NODE_OF, holdings)
    assert d.ok and d.members == (0, 2) and d.step == 20 and d.dropped_nodes == ("n1",)
    assert d.providers == ((0, 0), (1, 2), (2, 2))


def test_a_joining_node_takes_a_lost_node_s_place_in_the_rank_order():
    """A spare of one worker fills n1's place: the world keeps its size and layout, so each
    member's shards are the old ones at its position (nothing to reshard for a survivor)."""
    j = JOINER_BASE + 1
    spare = [Joiner(j, "n9", 0, 1)]
    holdings = {0: {"own": 20, "held": {2: 20}}, 2: {"own": 20, "held": {1: 20}}}
    d = from_snapshots(MEMBERS, {0: 23, 2: 23}, NODE_OF, holdings, spare)
    assert d.ok and d.members == (0, j, 2) and d.step == 20 and d.dropped_nodes == ("n1",)
    assert d.providers == ((0, 0), (1, 2), (2, 2)) and not d.refused
    assert Decision.from_json(d.to_json(), MEMBERS + (j,)) == d
    # A node of two workers does not fit n1's one: it is appended, and the world reshards.
    two = [Joiner(j, "n9", 0, 2), Joiner(j + 1, "n9", 1, 2)]
    d = from_snapshots(MEMBERS, {0: 23, 2: 23}, NODE_OF, holdings, two)
    assert d.ok and d.members == (0, 2, j, j + 1)
    # Half a node has not all asked: it waits for a later boundary, neither in nor refused.
    d = from_snapshots(MEMBERS, {0: 23, 2: 23}, NODE_OF, holdings, two[:1])
    assert d.ok and d.members == (0, 2) and not d.refused


def test_a_returning_node_grows_the_world_from_the_survivors_state_now():
    """No loss: the survivors posted their own state of the step they completed (the break
    for the joiner), and the world grows by resharding it."""
    j = JOINER_BASE + 3
    holdings = {0: {"own": 40, "now": 43, "held": {2: 40}}, 2: {"own": 40, "now": 43, "held": {0: 40}}}
    d = from_snapshots((0, 2), {0: 43, 2: 43}, NODE_OF, holdings, [Joiner(j, "n1", 0, 1)])
    assert d.ok and d.members == (0, 2, j) and d.step == 43 and d.dropped_nodes == ()
    assert d.providers == ((0, 0), (2, 2))
    assert not from_snapshots((0, 2), {0: 43, 2: 43}, NODE_OF, holdings).ok   # nothing lost, nobody joins
    # A survivor that did not copy its state now (a store hiccup): the snapshot's step serves.
    holdings[2]["now"] = -1
    d = from_snapshots((0, 2), {0: 43, 2: 43}, NODE_OF, holdings, [Joiner(j, "n1", 0, 1)])
    assert d.ok and d.step == 40 and d.members == (0, 2, j)


def test_a_copy_still_in_flight_falls_back_to_an_older_step_or_fails():
    # n2 had not received n1's snapshot of step 20 when n1 died: no step has all three.
    holdings = {0: {"own": 20, "held": {2: 20}}, 2: {"own": 20, "held": {}}}
    d = from_snapshots(MEMBERS, {0: 21, 2: 21}, NODE_OF, holdings)
    assert not d.ok and "no snapshot step" in d.error


def test_both_copies_lost_fails_for_the_disk_checkpoint():
    # n1 and its buddy n2 lost: n1's shards are nowhere.
    d = from_snapshots(MEMBERS, {0: 30}, NODE_OF, {0: {"own": 30, "held": {2: 30}}})
    assert not d.ok


def test_both_copies_lost_reload_the_checkpoint_in_process_on_every_survivor():
    # Four nodes: n1 and its buddy n2 lost together, n0 and n3 go on from the checkpoint.
    members, node_of = (0, 1, 2, 3), {0: "n0", 1: "n1", 2: "n2", 3: "n3"}
    arrived = {0: 30, 3: 31}
    d = from_checkpoint(members, arrived, node_of, can_reload={0, 3})
    assert d.ok and d.reload and d.members == (0, 3) and d.dropped_nodes == ("n1", "n2") and d.step == 0
    assert not d.providers and not d.fresh
    # One survivor without a loader: none reloads, torchrun's restart recovers.
    d = from_checkpoint(members, arrived, node_of, can_reload={0})
    assert not d.ok and "cannot load a checkpoint" in d.error
    # A node that lost one of its workers is left out whole, as for the snapshots.
    d = from_checkpoint((0, 1, 2, 3), {0: 5, 1: 5, 2: 5}, {0: "n0", 1: "n0", 2: "n1", 3: "n1"}, {0, 1, 2})
    assert d.ok and d.members == (0, 1) and d.dropped_nodes == ("n1",)
    assert not from_checkpoint(MEMBERS, {0: 1, 1: 1, 2: 1}, NODE_OF, set(MEMBERS)).ok   # nothing lost


def test_a_reload_decision_travels_through_the_store_and_hostile_ones_are_refused():
    d = Decision(ok=True, members=(0,), dropped_nodes=("n1", "n2"), reload=True)
    assert Decision.from_json(d.to_json(), MEMBERS) == d
    assert Decision.from_json(Decision(ok=True, members=(0, 2), step=3).to_json(), MEMBERS).reload is False
    for bad in ('"reload": 1', '"reload": "yes"'):
        with pytest.raises(ValueError):
            Decision.from_json(d.to_json().replace('"reload": true', bad), MEMBERS)
    with_state = Decision(ok=True, members=(0, 2), step=20, providers=((0, 0), (1, 2), (2, 2)), reload=True)
    with pytest.raises(ValueError):   # a reload comes with no other state
        Decision.from_json(with_state.to_json(), MEMBERS)


def test_nothing_lost_is_no_snapshot_recovery():
    d = from_snapshots(MEMBERS, {0: 3, 1: 3, 2: 3}, NODE_OF, {r: {"own": 0, "held": {}} for r in MEMBERS})
    assert not d.ok


def test_a_snapshot_decision_travels_through_the_store_and_hostile_ones_are_refused():
    d = Decision(ok=True, members=(0, 2), dropped_nodes=("n1",), step=20, providers=((0, 0), (1, 2), (2, 2)))
    assert Decision.from_json(d.to_json(), MEMBERS) == d
    for bad in ('[[0, 0], [0, 2]]', '[[7, 0]]', '[[1, 1]]'):   # an owner twice, outside, a lost provider
        text = d.to_json().replace('[[0, 0], [1, 2], [2, 2]]', bad)
        with pytest.raises(ValueError):
            Decision.from_json(text, MEMBERS)


@pytest.fixture
def store():
    from torch.distributed import TCPStore

    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield TCPStore("127.0.0.1", master.port, is_master=False, wait_for_workers=False)
    del master


def _closed_port() -> str:
    import socket

    with socket.socket() as s:   # bound, never listening: a connection is refused
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("posted,error", [({"own": 10, "held": {2: 10}, "reload": True}, ""),
                                          ({"own": 10, "held": {2: 10}}, "cannot load a checkpoint"),
                                          ({"own": 10, "held": {2: 10}, "reload": "yes"}, "lost 2 of 3 ranks")])
def test_a_survivor_of_two_lost_buddies_reloads_in_process_only_if_it_said_it_can(store, posted, error):
    """Through the real protocol on a real TCPStore: n1 and n2 (n1's buddy) are gone, their
    liveness ports refuse; n0's survivor holds no copy of n1's shards.  It reloads the
    checkpoint in process if its holdings said it can; a value that is not a flag counts as
    holdings that do not parse (none at all)."""
    from rankwatch.hooks.recovery.protocol import Round

    prefix = "rankwatch/job/round/1/"
    rounds = [Round(store, prefix, {"RANKWATCH_TOKEN": "t", "RANKWATCH_NODE_ID": f"n{r}"}, settle=5.0)
              for r in range(3)]
    for r, rnd in enumerate(rounds):
        rnd.register(r, 3, _closed_port())
    old = Membership(generation=0, rank=0, world_size=3, members=MEMBERS)
    d = rounds[0].agree(old, completed=12, replica_size=3, ready=False, settled=set(), holdings=posted)
    if not error:
        assert d.ok and d.reload and d.members == (0,) and d.dropped_nodes == ("n1", "n2"), d
    else:
        assert not d.ok and not d.reload and error in d.error, d


def test_a_lone_survivor_grows_by_resharding_its_one_replica(store):
    """A plain FSDP2 job down to one rank: that rank is a whole replica of one, yet the job's
    next mesh shards over the joiner too.  The joiner gets a share assembled from the
    survivor's state of the step it completed (``now``), not a replica's copy."""
    from rankwatch.hooks.recovery.protocol import Round

    prefix = "rankwatch/job/round/1/"
    survivor = Round(store, prefix, {"RANKWATCH_TOKEN": "t", "RANKWATCH_NODE_ID": "n0"}, settle=0.5)
    survivor.register(0, 1, _closed_port())
    joiner = Round(store, prefix, {"RANKWATCH_TOKEN": "t", "RANKWATCH_NODE_ID": "n2"}, settle=0.5)
    me = joiner.ask_to_join(_closed_port(), 0, 1)
    old = Membership(generation=1, rank=0, world_size=1, members=(0,))
    d = survivor.agree(old, completed=53, replica_size=1, ready=False, settled=set(),
                       holdings={"own": 50, "now": 53, "held": {}})
    assert d.ok and d.members == (0, me) and d.step == 53 and d.providers == ((0, 0),), d
    assert "resharded" in d.note, d


def test_a_standby_spare_is_placed_only_into_a_lost_node_s_place():
    """Hot spares stand by ahead of any loss: a recovery takes as many standby nodes as nodes
    were lost (the first to ask first), never one to grow the world; joiners that asked to
    join (a returning node) are all taken as before."""
    from rankwatch.hooks.recovery.decide import placeable

    a, b, c = (Joiner(JOINER_BASE + i, n, 0, 1, standby=True) for i, n in ((1, "s1"), (2, "s2"), (3, "s3")))
    back = Joiner(JOINER_BASE + 4, "n9", 0, 1)
    assert placeable([a, b, back], MEMBERS, {0: 5, 1: 5, 2: 5}, NODE_OF) == [back]   # nothing lost
    assert placeable([b, a, back], MEMBERS, {0: 5, 2: 5}, NODE_OF) == [a, back]      # n1 lost: the first
    assert placeable([a, b, c], MEMBERS, {0: 5}, NODE_OF) == [a, b]                   # n1 and n2 lost
    # Into n1's place, at the snapshot step: the world keeps its size and layout.
    holdings = {0: {"own": 20, "now": 23, "held": {2: 20}}, 2: {"own": 20, "now": 23, "held": {1: 20}}}
    d = from_snapshots(MEMBERS, {0: 23, 2: 23}, NODE_OF, holdings, placeable([a, b], MEMBERS, {0: 23, 2: 23}, NODE_OF))
    assert d.ok and d.members == (0, a.id, 2) and d.step == 20 and d.providers == ((0, 0), (1, 2), (2, 2)), d


def test_a_standby_request_travels_through_the_store_and_a_bad_flag_is_ignored(store):
    from rankwatch.hooks.recovery.protocol import Round

    prefix = "rankwatch/job/round/1/"
    spare = Round(store, prefix, {"RANKWATCH_TOKEN": "t", "RANKWATCH_NODE_ID": "s1"}, settle=0.5)
    me = spare.ask_to_join(_closed_port(), 0, 1, standby=True)
    other = spare.ask_to_join(_closed_port(), 0, 1)
    (j, k) = spare.waiting_joiners(store, set())
    assert (j.id, j.standby, k.id, k.standby) == (me, True, other, False)
    raw = spare.key(f"join/{me - JOINER_BASE}")
    store.set(raw, spare.seal.seal(raw, '{"node": "s1", "local_rank": 0, "local_world": 1, "standby": "yes"}'))
    settled: set[int] = set()
    assert [x.id for x in spare.waiting_joiners(store, settled)] == [other] and me in settled


def test_a_checkpoint_reload_places_a_spare_that_can_load_it_too():
    """Both copies of n1's shards gone (or the exchange cut): the survivors reload the
    checkpoint, and a spare whose loop can load it takes n1's place; one that cannot waits."""
    able = Joiner(JOINER_BASE + 1, "s1", 0, 1, standby=True, reload=True)
    unable = Joiner(JOINER_BASE + 2, "s2", 0, 1, standby=True)
    d = from_checkpoint(MEMBERS, {0: 23, 2: 23}, NODE_OF, {0, 2}, [able])
    assert d.ok and d.reload and d.members == (0, able.id, 2) and d.dropped_nodes == ("n1",), d
    d = from_checkpoint(MEMBERS, {0: 23, 2: 23}, NODE_OF, {0, 2}, [unable])
    assert d.ok and d.members == (0, 2) and not d.refused, d
