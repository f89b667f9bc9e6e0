"""Ranks stopped by a restart read restarting; ranks that died of the fault read dead."""

from __future__ import annotations

from rankwatch.agent.node.restarting import shown_state

DECIDED = 100.0


def test_a_rank_stopped_by_the_restart_is_restarting():
    assert shown_state("dead", last_seen=101.5, now=105.0, restarts=[DECIDED]) == "restarting"
    # Blocked in a collective, its last progress a little before the decision (seen in e2e: 0.1 s).
    assert shown_state("dead", last_seen=DECIDED - 0.5, now=105.0, restarts=[DECIDED]) == "restarting"


def test_the_rank_that_died_before_the_decision_is_dead():
    assert shown_state("dead", last_seen=DECIDED - 3.0, now=105.0, restarts=[DECIDED]) == "dead"


def test_a_worker_that_never_comes_back_is_dead_again():
    assert shown_state("dead", last_seen=101.5, now=DECIDED + 121, restarts=[DECIDED]) == "dead"


def test_other_states_and_no_restart_are_kept():
    assert shown_state("ok", last_seen=101.5, now=105.0, restarts=[DECIDED]) == "ok"
    assert shown_state("dead", last_seen=101.5, now=105.0, restarts=[]) == "dead"
