"""XID classification, throttle decoding, and what a reading means (pure functions, injected time)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from rankwatch.agent.gpu.base import THROTTLE_REASONS, GpuReading, XidEvent, decode_throttle
from rankwatch.agent.gpu.faults import ThrottleTracker, compare, xid_finding
from rankwatch.agent.gpu.xid import ACTIONS, action_for, describe


@pytest.mark.parametrize("xid,action", [
    (79, "reboot"),
    (48, "reset_gpu"), (64, "reset_gpu"), (95, "reset_gpu"), (119, "reset_gpu"), (120, "reset_gpu"),
    (140, "reset_gpu"), (74, "reset_gpu"),
    (13, "restart_app"), (31, "restart_app"), (94, "restart_app"), (8, "restart_app"),
    (43, "ignore"), (45, "ignore"), (63, "ignore"), (92, "ignore"), (154, "ignore"),
    (1, "unknown"),      # unused on Ampere and newer: contact support
    (54, "unknown"),     # a check (mechanicals), not an action
    (999, "unknown"),    # newer than the table
])
def test_xid_catalogue_actions(xid, action):
    assert action_for(xid) == action


def test_every_catalogued_action_is_one_of_the_contract_labels():
    assert {action_for(x) for x in range(0, 400)} <= set(ACTIONS)


def test_describe_names_the_well_known_xids():
    assert describe(79) == "XID 79 (GPU has fallen off the bus)"
    assert describe(4242) == "XID 4242"


@pytest.mark.parametrize("mask,names", [
    (0, ()),
    (0x1, ("gpu_idle",)),
    (0x4 | 0x40, ("sw_power_cap", "hw_thermal_slowdown")),
    (0x8 | 0x20 | 0x80, ("hw_slowdown", "sw_thermal_slowdown", "hw_power_brake_slowdown")),
    (0x1FF, THROTTLE_REASONS),
    (0x200 | 0x400 | 0x4, ("sw_power_cap",)),   # newer bits (board limit, reliability) are dropped
])
def test_throttle_mask_decoding(mask, names):
    assert decode_throttle(mask) == names


def test_xid_findings_follow_the_catalogue():
    fatal = xid_finding(XidEvent(gpu=1, xid=79, at=10.0))
    assert (fatal.kind, fatal.action, fatal.incident, fatal.xid, fatal.gpu) == ("fatal", "reboot", True, 79, 1)
    assert xid_finding(XidEvent(0, 63, 1.0)) is None
    unknown = xid_finding(XidEvent(0, 999, 1.0))
    # An unknown XID is an incident for a human, but only a risk for automation.
    assert (unknown.kind, unknown.action, unknown.incident) == ("risk", "unknown", True)


def reading(**kw) -> GpuReading:
    base = {"ecc": {("corrected", "volatile"): 0, ("uncorrected", "volatile"): 0},
            "remapped_rows": {"pending": 0, "failed": 0}}
    return GpuReading(index=kw.pop("index", 0), uuid="GPU-x", name="H100", **{**base, **kw})


def test_counts_on_the_first_reading_are_history_but_states_are_reported():
    first = reading(ecc={("uncorrected", "volatile"): 7}, remapped_rows={"failed": 1, "pending": 1})
    found = {(f.kind, f.reason) for f in compare(None, first)}
    assert found == {("fatal", "row_remap_failed"), ("risk", "row_remap_pending")}


def test_rising_ecc_counts():
    before = reading()
    after = reading(ecc={("corrected", "volatile"): 4, ("uncorrected", "volatile"): 1})
    found = {f.reason: f for f in compare(before, after)}
    assert found["ecc_uncorrected"].kind == "fatal" and found["ecc_uncorrected"].detail["new_errors"] == 1
    assert found["ecc_corrected"].kind == "risk" and not found["ecc_corrected"].incident
    # A counter that went down was reset: nothing to say.
    assert compare(after, before) == []


def test_aggregate_count_is_used_when_there_is_no_volatile_one():
    before = reading(ecc={("uncorrected", "aggregate"): 3})
    after = reading(ecc={("uncorrected", "aggregate"): 5})
    assert [f.reason for f in compare(before, after)] == ["ecc_uncorrected"]


def test_lost_gpu_is_fatal_once_and_counting_restarts_after_it_is_back():
    up, lost = reading(), GpuReading(0, "GPU-x", "H100", up=False, error="GPU is lost")
    (f,) = compare(up, lost)
    assert (f.kind, f.reason, f.action) == ("fatal", "gpu_lost", "reboot")
    assert compare(lost, lost) == []
    back = reading(ecc={("uncorrected", "volatile"): 9})
    assert compare(lost, back) == []  # a first reading again: its counts are history


@pytest.mark.parametrize("wanted,action", [
    ("gpu_reset", "reset_gpu"), ("drain_and_reset", "reset_gpu"), ("node_reboot", "reboot"),
    ("drain_p2p", "restart_app"),
])
def test_a_recovery_action_from_the_driver_is_fatal_once_per_change(wanted, action):
    healthy, asked = reading(recovery_action="none"), reading(recovery_action=wanted)
    (f,) = compare(healthy, asked)
    assert (f.kind, f.reason, f.action, f.incident) == ("fatal", "recovery_action", action, True)
    assert f.detail == {"recovery_action": wanted}
    assert compare(asked, asked) == []                       # still asked: said once
    assert [x.reason for x in compare(None, asked)] == ["recovery_action"]  # a state, even first
    assert compare(asked, healthy) == [] and compare(None, healthy) == []
    assert compare(reading(), reading()) == []               # a driver that cannot tell


def test_sustained_thermal_slowdown_is_one_risk_per_episode():
    tr = ThrottleTracker(timedelta(seconds=10))
    hot = reading(throttle=("sw_power_cap", "hw_thermal_slowdown"))
    assert tr.update(hot, 100.0) is None
    assert tr.update(hot, 109.0) is None
    f = tr.update(hot, 110.5)
    assert f is not None and f.reason == "throttle" and f.detail["throttle"] == ["hw_thermal_slowdown"]
    assert tr.update(hot, 200.0) is None  # still the same episode
    assert tr.update(reading(throttle=("sw_power_cap",)), 201.0) is None  # power capping alone is normal
    assert tr.update(hot, 202.0) is None
    assert tr.update(hot, 212.0) is not None  # a new episode
