"""The coordinator's hang watch on its own: a job view, an incident log, no coordinator."""

from __future__ import annotations

from rankwatch.agent.detect.hang_verdict import HangConfig
from rankwatch.agent.durable.incidents import IncidentLog
from rankwatch.agent.durable.decisions import DecisionLog
from rankwatch.agent.job.global_view import JobView
from rankwatch.agent.job.hang_watch import HangWatch
from rankwatch.agent.job.loadmeter import LoadMeter
from rankwatch.agent.job.pacing import LoadConfig
from rankwatch.proto import pb

T0 = 1000.0


def summary(node: str, seq: int, now: float, **rank) -> pb.NodeSummary:
    s = pb.NodeSummary(node_id=node, seq=seq, sent_at=now)
    s.ranks.append(pb.RankSummary(**{"connected": True, "alive": True, "steps_completed": 100,
                                     "step_seconds": 0.1, "activity": "train", **rank}))
    return s


def make() -> tuple[HangWatch, JobView, IncidentLog, list]:
    log = DecisionLog()
    load = LoadMeter(LoadConfig(), 0.25, 3.0, lambda: 0, clocks=(lambda: 0.0, lambda: 0.0))
    view = JobView(log, load, 64)
    incidents, told = IncidentLog(None), []
    return HangWatch(view, incidents, HangConfig(), load, lambda: 0.0, told.append), view, incidents, told


def sync_both(view: JobView, seq: int, now: float, n1_steps: int = 100, n1_progress: float = T0) -> None:
    view.take(summary("n0", seq, now, rank=0, step=50, progress_at=T0, last_seen=now, group_seqs={"0": 900}), now)
    view.take(summary("n1", seq, now, rank=1, step=50, progress_at=n1_progress, last_seen=now,
                      steps_completed=n1_steps, group_seqs={"0": 899}), now)


def test_a_hang_is_opened_named_and_told_and_then_ends_when_the_culprit_trains():
    watch, view, incidents, told = make()
    sync_both(view, 1, T0)
    assert watch.look(T0, view.snapshot, restarting=False, quiet_nodes=0) is None   # nothing stalled yet
    now = T0 + 6   # past the 5 s floor
    sync_both(view, 2, now)
    opened = watch.look(now, view.snapshot, restarting=False, quiet_nodes=0)
    assert opened is not None
    hang, found = opened
    assert (hang.node, hang.rank) == ("n1", 1) == (found.node, found.rank)
    assert watch.open == hang.id and told == [hang]
    assert "behind" in found.verdict.reason
    now += 1.5
    sync_both(view, 3, now, n1_steps=102, n1_progress=now)   # n1 trains again
    assert watch.look(now, view.snapshot, restarting=False, quiet_nodes=0) is None
    assert incidents.get(hang.id).detail["outcome"] == "resumed" and watch.open is None


def test_no_rank_is_looked_at_while_a_restart_is_under_way():
    watch, view, _, _ = make()
    looks = []
    sync_both(view, 1, T0)
    now = T0 + 6
    sync_both(view, 2, now)
    assert not watch.due(now, restarting=True, quiet_nodes=0)
    assert watch.look(now, lambda t: looks.append(t) or view.snapshot(t), restarting=True, quiet_nodes=0) is None
    assert looks == [] and watch.open is None
