"""The peer snapshots' plan (hooks/recovery/budget.py): on where the memory fits, K
sized so a snapshot costs at most 1 % of its K steps, sized again when the steps change;
driven with numbers and fixture files, never the host's."""

from __future__ import annotations

from pathlib import Path

import pytest

from rankwatch.hooks.recovery.budget import (
    HEADROOM_FLOOR, LIMIT_ENV, MAX_EVERY, PROBE_EVERY, REASONS, StepClock, every_for, host_memory, needs_replan,
    plan,
)

GiB = 1 << 30


def _plan(**kw):
    args = dict(shard_bytes=100 << 20, ranks_on_host=8, available_bytes=64 * GiB, cost_seconds=0.02,
                step_seconds=0.1)
    return plan(**{**args, **kw})


def test_k_keeps_a_snapshot_within_one_percent_of_its_steps():
    p = _plan(cost_seconds=0.018, step_seconds=0.056)
    assert p.on and p.reason == "fits"
    assert p.every == 33   # ceil(18 / 0.56)
    assert 0.018 / (p.every * 0.056) <= 0.01 < 0.018 / ((p.every - 1) * 0.056)
    assert "33 steps" in p.detail and "%" in p.detail


@pytest.mark.parametrize(("cost", "step", "k"), [
    (0.0, 0.1, 1),            # free (a GPU's side stream): every step
    (0.001, 0.1, 1),          # exactly 1 %
    (0.0011, 0.1, 2),
    (10.0, 0.001, MAX_EVERY),  # bounded
    (0.05, 0.0, MAX_EVERY),    # no step time: as rare as allowed
    (float("nan"), 0.1, MAX_EVERY),
])
def test_every_for_is_bounded(cost, step, k):
    assert every_for(cost, step) == k


def test_memory_counts_both_copies_and_every_rank_of_the_node():
    shard = 1 * GiB
    # 8 ranks x 2 copies x 1 GiB = 16 GiB: fits in 24 GiB less 20 % (19.2 GiB) ...
    assert _plan(shard_bytes=shard, available_bytes=24 * GiB).on
    # ... not in 18 GiB (14.4 after headroom), though one copy per rank (8 GiB) would
    off = _plan(shard_bytes=shard, available_bytes=18 * GiB)
    assert not off.on and off.every == 0 and off.reason == "memory"
    assert "16.00 GiB" in off.detail and "--snapshot-every K" in off.detail   # what turns them on
    # the same node with 4 ranks fits
    assert _plan(shard_bytes=shard, ranks_on_host=4, available_bytes=18 * GiB).on


def test_the_headroom_has_a_floor_and_a_limit_caps_what_is_seen():
    need = 2 * (10 << 20)   # one rank, 10 MiB shards
    assert not plan(shard_bytes=10 << 20, ranks_on_host=1, available_bytes=HEADROOM_FLOOR + need - 1).on
    assert plan(shard_bytes=10 << 20, ranks_on_host=1, available_bytes=HEADROOM_FLOOR + need).on
    capped = _plan(available_bytes=64 * GiB, limit_bytes=1 << 20)
    assert capped.reason == "memory"
    assert plan(shard_bytes=1 << 40, ranks_on_host=8, available_bytes=None).on   # unknown memory: assumed to fit


def test_before_measurements_it_probes_and_the_user_overrides():
    probe = _plan(cost_seconds=None)
    assert probe.on and probe.every == PROBE_EVERY and probe.reason == "measuring"
    assert _plan(step_seconds=None).reason == "measuring"
    forced = _plan(available_bytes=1, override=7)   # K > 0: on whatever the memory
    assert forced.on and forced.every == 7 and forced.reason == "override"
    off = _plan(override=0)
    assert not off.on and off.reason == "disabled" and "without the flag" in off.detail


def test_no_other_node_or_whole_replicas_turn_them_off():
    one = _plan(nodes=1)
    assert not one.on and one.reason == "single_node"
    rep = _plan(replicas=True)
    assert not rep.on and rep.reason == "replicas" and "--snapshot-every" in rep.detail
    assert _plan(nodes=1, override=5).on   # the user's K wins


def test_every_reason_is_in_the_fixed_set():
    plans = [_plan(), _plan(cost_seconds=None), _plan(override=3), _plan(override=0), _plan(available_bytes=1),
             _plan(nodes=1), _plan(replicas=True)]
    assert {p.reason for p in plans} == set(REASONS)
    assert all(REASONS[p.reason_code] == p.reason for p in plans)


def test_k_is_chosen_again_when_the_step_time_moves_more_than_twice():
    assert needs_replan(None, 0.1)          # never sized
    assert not needs_replan(None, None)     # nothing to size from
    assert not needs_replan(0.1, 0.19)
    assert not needs_replan(0.1, 0.051)
    assert needs_replan(0.1, 0.21)
    assert needs_replan(0.1, 0.049)


def test_the_step_clock_is_a_median_robust_to_a_slow_step():
    clock = StepClock(window=9)
    t = 0.0
    for period in [0.1] * 6 + [5.0] + [0.1] * 2:   # one checkpoint-slow step
        clock.tick(t)
        t += period
    clock.tick(t)
    assert clock.median() == pytest.approx(0.1)
    clock.restart()   # a recovery's pause is not a step
    clock.tick(t + 30.0)
    assert clock.median() == pytest.approx(0.1)
    assert StepClock().median() is None


def test_host_memory_reads_meminfo_the_cgroup_and_the_limit(tmp_path: Path):
    proc, cg = tmp_path / "proc", tmp_path / "cg"
    proc.mkdir()
    cg.mkdir()
    (proc / "meminfo").write_text("MemTotal:       32000000 kB\nMemAvailable:   20000000 kB\n")
    assert host_memory({}, proc, cg) == (20000000 * 1024, None)
    (cg / "memory.max").write_text("max\n")
    (cg / "memory.current").write_text("1000\n")
    assert host_memory({}, proc, cg) == (20000000 * 1024, None)
    (cg / "memory.max").write_text(f"{8 * GiB}\n")
    assert host_memory({}, proc, cg) == (20000000 * 1024, 8 * GiB - 1000)
    assert host_memory({LIMIT_ENV: "1048576"}, proc, cg) == (20000000 * 1024, 1 << 20)
    assert host_memory({LIMIT_ENV: "nonsense"}, tmp_path / "none", tmp_path / "none") == (None, None)


def test_host_memory_finds_the_process_own_cgroup(tmp_path: Path):
    proc, cg = tmp_path / "proc", tmp_path / "cg"
    (proc / "self").mkdir(parents=True)
    (cg / "job.slice").mkdir(parents=True)
    (proc / "meminfo").write_text("MemAvailable:   20000000 kB\n")
    (proc / "self" / "cgroup").write_text("0::/job.slice\n")
    (cg / "job.slice" / "memory.max").write_text("3000\n")
    (cg / "job.slice" / "memory.current").write_text("1000\n")
    assert host_memory({}, proc, cg) == (20000000 * 1024, 2000)


def test_k_also_keeps_the_exchange_in_flight_at_most_a_twentieth_of_the_time():
    """A cheap snapshot whose exchange takes long (waiting on the buddy, the network): K grows
    so that a node lost at a random moment finds a whole snapshot 95 % of the time."""
    p = _plan(cost_seconds=0.001, step_seconds=0.05, exchange_seconds=0.1)
    assert p.every == 40   # 0.1 / (0.05 x 0.05); the cost alone asks for 2
    assert _plan(cost_seconds=0.001, step_seconds=0.05, exchange_seconds=0.0).every == 2
    assert "100 ms" in p.detail
