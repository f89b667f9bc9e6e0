"""The coordinator's rule for a dead node (rankwatch.agent.job.node_death), case by case."""

from __future__ import annotations

from rankwatch.agent.job.node_death import all_ranks_died, judge, silence_is_evidence
from rankwatch.proto import pb


def _ranks(*states: str) -> list[pb.RankSummary]:
    return [pb.RankSummary(rank=i, connected=s == "up", alive=s == "alive", exited_cleanly=s == "done")
            for i, s in enumerate(states)]


def test_all_ranks_died_needs_ranks_and_every_one_gone_uncleanly():
    assert all_ranks_died(_ranks("gone", "gone"))
    assert not all_ranks_died([])                       # no ranks yet: nothing died
    for other in ("up", "alive", "done"):
        assert not all_ranks_died(_ranks("gone", other))


def test_a_silent_agent_is_dead_only_while_its_silence_is_evidence():
    assert judge(10.0, silent=True, silence_counts=True, ranks_died=False, died_since=None, grace=60) == \
        ("its agent went silent", None)
    assert judge(10.0, silent=True, silence_counts=False, ranks_died=False, died_since=None, grace=60) == (None, None)


def test_silence_is_no_evidence_when_every_node_or_a_burst_of_them_went_quiet():
    rule = dict(burst_share=0.02, burst_nodes=4)
    assert silence_is_evidence(1, 2, **rule) and not silence_is_evidence(2, 2, **rule), \
        "every node quiet at once: the coordinator is the one cut off"
    assert silence_is_evidence(4, 8, **rule), "up to burst_nodes, in any job"
    assert not silence_is_evidence(5, 8, **rule)
    # 2 % of 2,048 nodes is 40.96: a whole rack of 32 is still excluded, 110 at once are not.
    assert silence_is_evidence(32, 2048, **rule) and silence_is_evidence(40, 2048, **rule)
    assert not silence_is_evidence(41, 2048, **rule) and not silence_is_evidence(110, 2048, **rule)


def test_dead_ranks_are_a_dead_node_only_after_the_grace():
    why, since = judge(100.0, silent=False, silence_counts=True, ranks_died=True, died_since=None, grace=60)
    assert (why, since) == (None, 100.0)                # first seen: the clock starts
    assert judge(159.0, silent=False, silence_counts=True, ranks_died=True, died_since=since, grace=60) == (None, 100.0)
    assert judge(160.0, silent=False, silence_counts=True, ranks_died=True, died_since=since, grace=60) == \
        ("all its ranks died", 100.0)
    # A restart's new ranks came back within the grace: the clock stops.
    assert judge(130.0, silent=False, silence_counts=True, ranks_died=False, died_since=since, grace=60) == (None, None)
