"""Goodput as a reader: every bucket from incidents, decisions and step progress, with moved clocks."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
from prometheus_client import generate_latest

from conftest import parse_metrics
from rankwatch.address import Address
from rankwatch.agent.durable.decisions import Decision
from rankwatch.agent.job.goodput import KINDS, Progress, StepProgress, breakdown
from rankwatch.agent.durable.incidents import Incident
from rankwatch.agent.server import Agent, AgentConfig
from rankwatch.proto import pb

T0 = 1000.0


def started(step_seconds: float = 1.0) -> StepProgress:
    """A job whose first step completed at T0 (it started at T0 - step_seconds)."""
    p = StepProgress()
    p.observe(T0, [1, 1], step_seconds)
    return p


def incident(kind: str, at: float, n: int = 1, step: int = 0, node: str = "n0", **detail) -> Incident:
    return Incident(id=f"{kind}-{n}", kind=kind, node=node, rank=0, step=step, detected_at=at, detail=detail)


def exclude(at: float, n: int) -> Decision:
    return Decision(id=f"job/exclude-{n}", kind="exclude", node=f"n{n}", generation=n, reason="test",
                    decided_at=at, seq=n)


def lost(now: float, *, incidents=(), decisions=(), progress: Progress | None = None) -> dict[str, float]:
    b = breakdown(now, incidents=incidents, decisions=decisions, progress=progress or started().snapshot())
    assert b is not None
    assert b["productive"] == pytest.approx(max(0.0, b["elapsed"] - sum(b[k] for k in KINDS[1:])))
    return b


def test_nothing_before_the_first_step_then_all_productive():
    p = StepProgress()
    p.observe(T0 - 5, [0, 0], 1.0)  # ranks connected, no step completed yet
    assert breakdown(T0, incidents=[], decisions=[], progress=p.snapshot()) is None
    p.observe(T0, [1, 1], 1.0)
    b = lost(T0 + 99, progress=p.snapshot())
    assert b == {"productive": 100.0, "hang": 0.0, "restart": 0.0, "recompute": 0.0, "checkpoint": 0.0,
                 "elapsed": 100.0}


def test_a_hang_counts_from_its_last_progress_to_its_resolution_once():
    hang = incident("hang", T0 + 20, stalled_seconds=6.0, resolved_at=T0 + 30)
    copy = Incident(id="n0/hang-1", kind="hang", node="n1", rank=0, step=0, detected_at=T0 + 20,
                    detail=dict(hang.detail))  # a node's copy of the coordinator's verdict
    assert lost(T0 + 99, incidents=[hang, copy])["hang"] == pytest.approx(16.0)
    open_hang = incident("hang", T0 + 20, n=2, stalled_seconds=6.0)
    assert lost(T0 + 99, incidents=[open_hang])["hang"] == pytest.approx(6.0)


def test_a_restart_counts_until_it_recovered_or_until_now():
    done = incident("restart", T0 + 40, started_at=T0 + 40, recovered_after_seconds=8.0)
    assert lost(T0 + 99, incidents=[done], decisions=[exclude(T0 + 40, 1)])["restart"] == pytest.approx(8.0)
    going = incident("restart", T0 + 40, started_at=T0 + 40)
    assert lost(T0 + 99, incidents=[going], decisions=[exclude(T0 + 40, 1)])["restart"] == pytest.approx(59.0)


def test_a_superseded_restart_is_closed_at_the_next_ones_decision():
    # The first restart never recovered: the second decision (10 s later) superseded it.
    first = incident("restart", T0 + 40, n=1, started_at=T0 + 40)
    second = incident("restart", T0 + 50, n=2, started_at=T0 + 50, recovered_after_seconds=5.0)
    b = lost(T0 + 99, incidents=[first, second], decisions=[exclude(T0 + 40, 1), exclude(T0 + 50, 2)])
    assert b["restart"] == pytest.approx(10.0 + 5.0)


def recovery(at: float, n: int = 1, node: str = "n0", ok: bool = True, **phases: float) -> Incident:
    """An in-process recovery's incident as the node agent records it (agent/node/recoveries.py)."""
    return incident("restart", at, n=n, step=50, node=node, tier="in_process", ok=ok, old_world_size=8,
                    new_world_size=6, dropped_nodes=["n3"], phases=phases, error="" if ok else "store timeout",
                    started_at=at)


def test_an_in_process_recovery_counts_as_restart_until_its_first_step():
    done = recovery(T0 + 40, left_step=0.5, agreed=1.5, reinitialised=3.0, restored=4.0, first_step=6.0)
    b = lost(T0 + 99, incidents=[done])
    assert b["restart"] == pytest.approx(6.0) and b["hang"] == 0.0
    # Every node reports the same recovery (a second node's, a moment later on the coordinator's
    # clock, and a node's phases a little longer): the time under them counts once.
    other = recovery(T0 + 40.3, n=2, node="n1", left_step=0.2, agreed=1.4, first_step=6.1)
    assert lost(T0 + 99, incidents=[done, other])["restart"] == pytest.approx(6.4)
    # A recovery without its first step yet lasts until the last phase it reached.
    assert lost(T0 + 99, incidents=[recovery(T0 + 40, left_step=0.5, agreed=2.5)])["restart"] == pytest.approx(2.5)


def test_a_hang_overlapping_an_in_process_recovery_is_not_counted_twice():
    # No progress from T0 + 30; the hang is called at T0 + 36 and ends when steps resume at
    # T0 + 45; the ranks caught the failure at T0 + 38 and trained again 6 s later.
    hang = incident("hang", T0 + 36, stalled_seconds=6.0, resolved_at=T0 + 45)
    done = recovery(T0 + 38, left_step=1.0, agreed=2.0, first_step=6.0)
    b = lost(T0 + 99, incidents=[hang, done])
    assert b["restart"] == pytest.approx(6.0)
    assert b["hang"] == pytest.approx(15.0 - 6.0)
    assert b["productive"] == pytest.approx(b["elapsed"] - 15.0)


def test_a_failed_attempt_then_a_torchrun_restart_is_not_counted_twice():
    # The attempt caught the failure at T0 + 40 and gave up 4 s later; the coordinator had
    # decided a torchrun restart at T0 + 42, which recovered 20 s after its decision.
    failed = recovery(T0 + 40, ok=False, left_step=1.0, agreed=4.0)
    fallback = incident("restart", T0 + 42, n=2, started_at=T0 + 42, recovered_after_seconds=20.0)
    b = lost(T0 + 99, incidents=[failed, fallback], decisions=[exclude(T0 + 42, 1)])
    assert b["restart"] == pytest.approx(22.0)
    # Decided only after the attempt gave up: both count, nothing twice.
    late = incident("restart", T0 + 50, n=2, started_at=T0 + 50, recovered_after_seconds=20.0)
    b = lost(T0 + 99, incidents=[failed, late], decisions=[exclude(T0 + 50, 1)])
    assert b["restart"] == pytest.approx(24.0)
    # A failed attempt never runs on until now or the next decision, as an open torchrun restart does.
    assert lost(T0 + 99, incidents=[failed])["restart"] == pytest.approx(4.0)


def test_workers_that_went_back_to_a_peer_snapshot_in_process_recompute_the_steps_since():
    """The same processes, world 3 -> 2, back to the snapshot at step 80 from step 84: steps
    81..84 are trained again (recompute), and what comes after them is new work."""
    p = StepProgress()
    for s in range(1, 85):
        p.observe(T0 + s - 1, [s, s, s], 1.0, [(100, s, s), (101, s, s), (102, s, s)])
    p.observe(T0 + 86, [81, 81], 1.0, [(100, 81, 85), (101, 81, 85)])
    p.observe(T0 + 89, [84, 84], 1.0, [(100, 84, 88), (101, 84, 88)])
    p.observe(T0 + 95, [90, 90], 1.0, [(100, 90, 94), (101, 90, 94)])
    (r,) = p.snapshot().resumes
    assert (r.step, r.high_water) == (81, 84)
    assert lost(T0 + 95, progress=p.snapshot())["recompute"] == pytest.approx(3.0)   # 82..84 (81 was the dip's)


def test_recompute_counts_the_steps_trained_again_after_resuming_from_an_older_checkpoint():
    p = started(step_seconds=0.5)
    for step in range(2, 61):
        p.observe(T0 + step, [step, step - 1], 0.5)  # one rank a step behind is no resume
    assert p.snapshot().resumes == ()
    # Restarted from the checkpoint at step 40 (steps 41..60 were lost).
    p.observe(T0 + 80, [40, 40], 0.5)
    assert lost(T0 + 80, progress=p.snapshot())["recompute"] == 0.0
    p.observe(T0 + 83, [45, 45], 0.5)
    assert lost(T0 + 83, progress=p.snapshot())["recompute"] == pytest.approx(5 * 0.5)
    p.observe(T0 + 85, [50, 50], 0.5)
    # A second failure while retraining: back to step 40 again; 41..50 were trained twice for nothing.
    p.observe(T0 + 90, [40, 40], 0.5)
    p.observe(T0 + 99, [70, 70], 0.5)  # past the old mark: steps 61..70 are new work
    assert lost(T0 + 99, progress=p.snapshot())["recompute"] == pytest.approx((10 + 20) * 0.5)
    assert [(r.step, r.high_water) for r in p.snapshot().resumes] == [(40, 60), (40, 60)]


def test_checkpoint_time_counts_each_saved_step_once_at_its_longest():
    saves = [incident("checkpoint", T0 + 10, n=1, step=40, seconds=2.0, ok=True),
             incident("checkpoint", T0 + 10, n=2, step=40, node="n1", seconds=3.0, ok=True),
             incident("checkpoint", T0 + 30, n=3, step=80, seconds=1.0, ok=False)]
    assert lost(T0 + 99, incidents=saves)["checkpoint"] == pytest.approx(4.0)


def test_lost_time_never_exceeds_the_elapsed_time():
    going = incident("restart", T0 - 500, started_at=T0 - 500)
    b = lost(T0 + 9, incidents=[going], decisions=[exclude(T0 - 500, 1)])
    assert b["productive"] == 0.0 and b["elapsed"] == pytest.approx(10.0)


def test_the_agent_exports_the_reader_and_summary_feeds_nothing(tmp_path):
    agent = Agent(AgentConfig(node_id="n0", listen=[Address(path=str(tmp_path / "a.sock"))],
                              metrics_port=None))
    try:
        rank = agent.state.hello(pb.Hello(rank=0, world_size=1, pid=os.getpid(), node_id="n0", backend="gloo"))
        rank.step, rank.steps_completed = 50, 50
        agent.summary(1)
        assert agent.goodput(T0) is None, "summary() has no goodput side effect"
        agent.progress.observe(T0, [1], 1.0)
        agent.incidents.add(kind="checkpoint", node="n0", rank=0, step=40, detected_at=T0 + 5,
                            detail={"ok": True, "seconds": 4.0})
        m = parse_metrics(generate_latest(agent.registry).decode())
        now = agent.state.clock()
        assert m[("rankwatch_goodput_ratio", frozenset({("node", "n0")}))] == pytest.approx(
            1 - 4.0 / (now - T0 + 1.0), rel=1e-3)
        assert m[("rankwatch_training_time_seconds_total",
                  frozenset({("node", "n0"), ("kind", "checkpoint")}))] == pytest.approx(4.0)
    finally:
        agent.stop(timedelta(0))


def _trained_to(step: int, step_seconds: float = 1.0) -> StepProgress:
    p = started(step_seconds)
    for s in range(2, step + 1):
        p.observe(T0 + s - 1, [s, s], step_seconds)  # step s completes at T0 + s - 1
    return p


def test_workers_restarted_without_a_decision_count_their_downtime_as_restart():
    """A spare that joins restarts every worker through torchrun: no decision, no incident,
    but the workers are down from the last step until they step again (from a checkpoint)."""
    p = _trained_to(60)                  # step 60 at T0 + 59
    p.observe(T0 + 69, [40, 40], 1.0)    # back from the checkpoint at step 40, 10 s later
    b = lost(T0 + 99, progress=p.snapshot())
    assert b["restart"] == pytest.approx(10.0)
    assert b["hang"] == 0.0


def test_a_hang_then_a_restart_counts_each_second_once():
    """Stalled from step 60 (T0 + 59) until excluded at T0 + 65; the restart until T0 + 69,
    when the workers step again from a checkpoint: 6 s of hang, 4 s of restart, not 10 + 4."""
    p = _trained_to(60)
    p.observe(T0 + 69, [40, 40], 1.0)
    hang = incident("hang", T0 + 65, stalled_seconds=6.0, resolved_at=T0 + 65)
    restart = incident("restart", T0 + 65, started_at=T0 + 65, recovered_after_seconds=4.0)
    b = lost(T0 + 99, incidents=[hang, restart], decisions=[exclude(T0 + 65, 1)], progress=p.snapshot())
    assert b["hang"] == pytest.approx(6.0)
    assert b["restart"] == pytest.approx(4.0)


def test_new_workers_that_have_not_stepped_yet_do_not_hide_a_resume():
    """Between a restart and the new workers' first step, the connected ranks read -1."""
    p = _trained_to(60)
    p.observe(T0 + 65, [-1, -1], 1.0)    # the new workers connected, no step yet
    p.observe(T0 + 69, [41, 41], 1.0)    # their first step, from the checkpoint at step 40
    b = lost(T0 + 69, progress=p.snapshot())
    assert [(r.step, r.high_water) for r in p.snapshot().resumes] == [(41, 60)]
    assert b["restart"] == pytest.approx(10.0)


def test_new_workers_resumed_behind_the_mark_even_when_no_sample_caught_the_dip():
    """The new workers passed the old top before the first sample that saw them: their pids
    and their own step count still show the resume from the checkpoint at step 80."""
    p = StepProgress()
    for s in range(1, 85):
        p.observe(T0 + s - 1, [s, s], 1.0, [(100, s, s), (101, s, s)])   # step 84 at T0 + 83
    p.observe(T0 + 95, [86, 86], 1.0, [(200, 86, 6), (201, 86, 6)])     # from step 80, 6 steps in
    (r,) = p.snapshot().resumes
    assert (r.step, r.high_water, r.at, r.down_from) == (80, 84, T0 + 89, T0 + 83)
    b = lost(T0 + 95, progress=p.snapshot())
    assert b["restart"] == pytest.approx(6.0)               # down from T0 + 83 to T0 + 89
    assert b["recompute"] == pytest.approx(4.0)             # steps 81..84 again


def test_workers_that_regrouped_in_process_did_not_resume():
    p = StepProgress()
    for s in range(1, 85):
        p.observe(T0 + s - 1, [s, s, s], 1.0, [(100, s, s), (101, s, s), (102, s, s)])
    p.observe(T0 + 90, [90, 90], 1.0, [(100, 90, 90), (101, 90, 90)])   # the same two, world 3 -> 2
    assert p.snapshot().resumes == ()
