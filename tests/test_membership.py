"""The coordinator's count of nodes it cannot hear (``agent/job/node_floor.py``)."""

from __future__ import annotations

from rankwatch.agent.job.node_floor import agentless_nodes


def test_every_rank_heard_means_no_agentless_node():
    assert agentless_nodes([("n0", 0, 4), ("n0", 1, 4), ("n1", 2, 4), ("n1", 3, 4)]) == 0


def test_a_nodes_worth_of_unheard_ranks_is_one_node():
    # n0's agent died: ranks 0 and 1 train on, unheard.
    assert agentless_nodes([("n1", 2, 6), ("n1", 3, 6), ("n2", 4, 6), ("n2", 5, 6)]) == 1
    assert agentless_nodes([("n2", 2, 3)]) == 2   # one rank per node: two unheard nodes


def test_a_known_node_without_ranks_may_own_the_unheard_ones():
    rows = [("n1", 2, 4), ("n1", 3, 4)]
    assert agentless_nodes(rows) == 1
    assert agentless_nodes(rows, rankless_nodes=1) == 0
    assert agentless_nodes(rows, rankless_nodes=3) == 0


def test_the_newest_world_counts_and_nothing_connected_counts_nothing():
    # Ranks of an old world of 2 beside the current world of 4, all of which are heard.
    rows = [("n0", 0, 2), ("n0", 0, 4), ("n0", 1, 4), ("n1", 2, 4), ("n1", 3, 4)]
    assert agentless_nodes(rows) == 0
    assert agentless_nodes([]) == 0
    assert agentless_nodes([("n0", 7, 4)]) == 0   # no valid rank: no node size to count in
