"""The coordinator's rule for a dead node (rankwatch.agent.node_death), case by case."""

from __future__ import annotations

from rankwatch.agent.node_death import all_ranks_died, judge
from rankwatch.proto import pb


def _ranks(*states: str) -> list[pb.RankSummary]:
    return [pb.RankSummary(rank=i, connected=s == "up", alive=s == "alive", exited_cleanly=s == "done")
            for i, s in enumerate(states)]


def test_all_ranks_died_needs_ranks_and_every_one_gone_uncleanly():
    assert all_ranks_died(_ranks("gone", "gone"))
    assert not all_ranks_died([])                       # no ranks yet: nothing died
    for other in ("up", "alive", "done"):
        assert not all_ranks_died(_ranks("gone", other))


def test_a_silent_agent_is_dead_only_while_another_node_still_syncs():
    assert judge(10.0, silent=True, others_live=True, ranks_died=False, died_since=None, grace=60) == \
        ("its agent went silent", None)
    # Every node quiet at once: the coordinator is the one cut off, so nobody is dead.
    assert judge(10.0, silent=True, others_live=False, ranks_died=False, died_since=None, grace=60) == (None, None)


def test_dead_ranks_are_a_dead_node_only_after_the_grace():
    why, since = judge(100.0, silent=False, others_live=True, ranks_died=True, died_since=None, grace=60)
    assert (why, since) == (None, 100.0)                # first seen: the clock starts
    assert judge(159.0, silent=False, others_live=True, ranks_died=True, died_since=since, grace=60) == (None, 100.0)
    assert judge(160.0, silent=False, others_live=True, ranks_died=True, died_since=since, grace=60) == \
        ("all its ranks died", 100.0)
    # A restart's new ranks came back within the grace: the clock stops.
    assert judge(130.0, silent=False, others_live=True, ranks_died=False, died_since=since, grace=60) == (None, None)
