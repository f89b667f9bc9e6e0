"""Every agent-side checkpoint trigger, decided in checkpoint_policy: pure functions of their inputs."""

from __future__ import annotations

from rankwatch.agent.detect.checkpoint_due import (MAX_LEAD_STEPS, MIN_LEAD_STEPS, RISK_EVERY_SECONDS, evictions_due, risk_due,
                                               save_step, wants_eviction)


def test_save_step_leads_the_fastest_rank_by_the_lead_time_in_steps():
    assert save_step(100, step_seconds=0.1, lead_seconds=2.0) == (120, True)
    assert save_step(100, step_seconds=0.3, lead_seconds=2.0) == (107, True)   # ceil(6.67)
    # Slow steps or no step time yet: never fewer than the minimum lead.
    assert save_step(100, step_seconds=10.0, lead_seconds=2.0) == (100 + MIN_LEAD_STEPS, True)
    assert save_step(100, step_seconds=0.0, lead_seconds=2.0) == (100 + MIN_LEAD_STEPS, True)
    # A step time near zero (a hostile or broken report) never sends the step out of range.
    assert save_step(100, step_seconds=1e-300, lead_seconds=2.0) == (100 + MAX_LEAD_STEPS, True)


def test_a_request_while_one_is_still_ahead_is_that_one():
    assert save_step(100, 0.1, 2.0, pending=[50, 110, 115]) == (115, False)
    assert save_step(120, 0.1, 2.0, pending=[50, 110, 115]) == (140, True)   # all are behind now


def test_risk_checkpoint_at_most_once_per_interval():
    assert risk_due(1000.0, None)
    assert not risk_due(1000.0 + RISK_EVERY_SECONDS - 1, 1000.0)
    assert risk_due(1000.0 + RISK_EVERY_SECONDS, 1000.0)
    assert risk_due(5.0, 0.0, every=5.0) and not risk_due(4.9, 0.0, every=5.0)


def test_eviction_only_for_a_costly_straggler_and_only_once_its_checkpoint_is_saved():
    assert wants_eviction(1.25, 1.25) and not wants_eviction(1.2, 1.25)
    assert not wants_eviction(1e9, float("inf"))
    planned = {"a": 120, "b": 200}
    assert evictions_due(planned, []) == []
    assert evictions_due(planned, [100, 119]) == []
    assert evictions_due(planned, [100, 150]) == ["a"]
    assert sorted(evictions_due(planned, [250])) == ["a", "b"]
