"""The agreement's tally: posts numbered by arrival, one per node when a node's first rank posts
for its node, and the decision's members as runs.  Pure parts directly; the per-node path over a
real TCPStore with real liveness ports (a lost node's refuse)."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch.distributed as dist

from rankwatch.address import NODE_ID_ENV
from rankwatch.hooks.recovery.decide import Decision, Membership
from rankwatch.hooks.recovery.net import Liveness
from rankwatch.hooks.recovery.protocol import Round
from rankwatch.hooks.recovery.store import ROUND_ENV, STORE_ENV, connect
from rankwatch.hooks.recovery.tally import Tally, encode_post, runs, unruns


def test_runs_round_trip_and_a_forged_length_is_refused():
    ids = (*range(0, 8), *range(16, 40), 41, 1 << 20 | 1)
    assert runs(ids) == [[0, 8], [16, 24], [41, 1], [1 << 20 | 1, 1]]
    assert unruns(runs(ids), len(ids)) == ids
    with pytest.raises(ValueError):
        unruns([[0, 10**9]], 64)
    with pytest.raises(ValueError):
        unruns([[3, 0]], 64)


def test_a_decision_of_16384_members_is_a_few_hundred_bytes_and_reads_back():
    world = tuple(range(16384))
    members = tuple(r for r in world if not 8 <= r < 16)
    d = Decision(ok=True, members=members, dropped_nodes=("sim00001",), step=41)
    text = d.to_json()
    assert len(text) < 400
    assert Decision.from_json(text, world) == d
    # A decision of the older form (a member list) still reads.
    old = text.replace('"runs": [[0, 8], [16, 16368]]', '"members": ' + str(list(members)))
    assert Decision.from_json(old, world).members == members


def test_posts_that_do_not_parse_or_name_others_count_for_nothing():
    t = Tally(range(4))
    t.take(encode_post({0: (5, False, None), 1: (5, True, None)}))
    t.take(encode_post({1: (9, False, None), 7: (5, False, None)}))   # 1 again, 7 not of the world
    t.take("not json")
    t.take(None)                                                      # a post that never came
    t.take('{"2": [5, false, {"held": {}, "own": -5}]}')               # holdings out of range: none
    t.take(encode_post({3: (4, False, {"held": {"0": 4}, "own": 4, "now": 5, "reload": True})}))
    t.take('{"9": "x"}')
    assert t.read == 7
    assert t.steps == {0: 5, 1: 5, 2: 5, 3: 4} and t.ready == {1} and set(t.holdings) == {3}
    t = Tally(range(2))
    t.take('{"0": [3, false, null], "1": "not an entry"}')
    assert t.missing() == {1}


def test_one_post_per_node_decides_and_every_node_reads_it():
    """Three nodes of two ranks; node n2 lost.  n0's and n1's first ranks post for their node:
    two posts in all (the arrival count), and both read the same decision without n2."""
    master = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    env = {STORE_ENV: f"127.0.0.1:{master.port}", ROUND_ENV: "t/"}
    rounds = [Round(*connect(env), {**env, NODE_ID_ENV: f"n{r // 2}"}, settle=5.0) for r in range(6)]
    alive = [Liveness() for _ in range(6)]
    for r, round_ in enumerate(rounds):
        round_.register(r, 6, alive[r].address)
    for r in (4, 5):
        alive[r].close()   # n2's processes are gone: their liveness ports refuse
    old = Membership(generation=0, rank=0, world_size=6, members=tuple(range(6)))
    got: dict = {}

    def n1_first_rank() -> None:
        leader = Round(*connect(env), {**env, NODE_ID_ENV: "n1"}, settle=5.0)
        got["n1"] = leader.agree(Membership(generation=0, rank=2, world_size=6, members=old.members), 7, 2, False,
                                 set(), node_entries={3: (7, False, None)})

    thread = threading.Thread(target=n1_first_rank)
    thread.start()
    got["n0"] = rounds[0].agree(old, 7, 2, False, set(), node_entries={1: (7, False, None)})
    thread.join(30)
    for a in alive[:4]:
        a.close()
    assert got["n0"].ok and got["n0"].members == (0, 1, 2, 3) and got["n0"].dropped_nodes == ("n2",)
    assert got["n1"] == got["n0"]
    assert int(master.add(rounds[0].key("gen/1/arrived"), 0)) == 2   # one post per node
