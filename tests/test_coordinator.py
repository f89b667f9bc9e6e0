"""The coordinator's decisions from synthetic node summaries (the e2e tests run real jobs)."""

from __future__ import annotations

import pytest

from rankwatch.agent.wire import windows as work_windows
from rankwatch.agent.job.coordinator import Coordinator, PolicyConfig
from rankwatch.agent.durable.incidents import IncidentLog
from rankwatch.proto import pb


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def summary(node, seq, now, ranks):
    s = pb.NodeSummary(node_id=node, seq=seq, sent_at=now)
    for r in ranks:
        s.ranks.append(pb.RankSummary(**{"connected": True, "alive": True, "steps_completed": 100,
                                         "step_seconds": 0.1, "activity": "train", **r}))
    return s


def make(policy=None, straggler=None):
    clock = Clock()
    return Coordinator("n0", incidents=IncidentLog(None), policy=policy or PolicyConfig(),
                       straggler=straggler, clock=clock), clock


def eviction_checkpoints(c, node):
    """The checkpoints the coordinator decided before evicting ``node``."""
    return [d for d in c.decisions if d.kind == "checkpoint" and f"before evicting {node}" in d.reason]


def test_names_the_culprit_on_another_node_and_excludes_it():
    c, clock = make()
    t = clock.t
    c.sync(summary("n0", 1, t, [dict(rank=0, step=50, progress_at=t, last_seen=t, group_seqs={"0": 900})]))
    c.sync(summary("n1", 1, t, [dict(rank=1, step=50, progress_at=t, last_seen=t, group_seqs={"0": 899},
                                    stopped=False)]))
    clock.t += 6  # beyond the 5 s floor; both nodes keep syncing, nobody progresses
    c.sync(summary("n0", 2, clock.t, [dict(rank=0, step=50, progress_at=t, last_seen=clock.t,
                                           group_seqs={"0": 900})]))
    c.sync(summary("n1", 2, clock.t, [dict(rank=1, step=50, progress_at=t, last_seen=clock.t,
                                           group_seqs={"0": 899})]))
    c.evaluate()
    (hang,) = [i for i in c.incidents.items if i.kind == "hang"]
    assert (hang.node, hang.rank) == ("n1", 1) and "behind" in hang.detail["reason"]
    assert c.excluded == {"n1": c.excluded["n1"]} and c.generation == 1
    (d,) = [d for d in c.decisions if d.kind == "exclude"]
    assert d.node == "n1" and d.generation == 1
    # The decision travels in every sync reply; the culprit's node also gets the incident.
    reply = c.sync(summary("n1", 3, clock.t, []))
    assert [x.id for x in reply.decisions] == [d.id]
    assert any(i.kind == "hang" for i in reply.incidents)



def test_an_open_hang_is_looked_at_again_only_once_something_that_could_end_it_changed():
    """While a job stays hung, another look at every rank finds what the last one found: the
    coordinator looks again when a rank progressed (or a stream closed, a node was excluded or
    went silent), and at least every 30 s."""
    c, clock = make(PolicyConfig(exclude_hung=False))
    looks = []
    snapshot = c.snapshot
    c.snapshot = lambda now: looks.append(now) or snapshot(now)
    t, seq = clock.t, 0

    def sync_both(n1_steps=100, n1_progress=t):
        nonlocal seq
        seq += 1
        c.sync(summary("n0", seq, clock.t, [dict(rank=0, step=50, progress_at=t, last_seen=clock.t,
                                                 group_seqs={"0": 900})]))
        c.sync(summary("n1", seq, clock.t, [dict(rank=1, step=50, progress_at=n1_progress, last_seen=clock.t,
                                                 steps_completed=n1_steps, group_seqs={"0": 899})]))

    sync_both()
    clock.t += 6
    sync_both()
    c.evaluate()
    (hang,) = [i for i in c.incidents.items if i.kind == "hang"]
    looks.clear()
    for _ in range(6):   # both nodes heard every 1.5 s, nobody progresses
        clock.t += 1.5
        sync_both()
        c.evaluate()
    assert looks == [] and c.incidents.get(hang.id).resolved_at is None
    clock.t += 30 - 9
    sync_both()
    c.evaluate()
    assert len(looks) == 1, "the backstop: one look after 30 s"
    clock.t += 1.5
    sync_both(n1_steps=102, n1_progress=clock.t)   # n1 trains again
    c.evaluate()
    assert len(looks) == 2 and c.incidents.get(hang.id).detail["outcome"] == "resumed"
    assert c.incidents.get(hang.id).resolved_at is not None


def test_no_rank_is_looked_at_while_an_exclusions_restart_is_under_way():
    """A hung job's culprit node is excluded: while its restart is under way every worker is
    stopped, as a hang would look, and the coordinator acts on no hang; it looks at no rank
    until the restart is over (here: its 120 s bound, as no new worker steps)."""
    c, clock = make(PolicyConfig(restart_quiet_seconds=120))
    looks = []
    snapshot = c.snapshot
    c.snapshot = lambda now: looks.append(now) or snapshot(now)
    t, seq = clock.t, 0

    def sync_all():
        nonlocal seq
        seq += 1
        for node, rank, at in (("n0", 0, 900), ("n1", 1, 899), ("n2", 2, 900)):
            c.sync(summary(node, seq, clock.t, [dict(rank=rank, step=50, progress_at=t, last_seen=clock.t,
                                                      group_seqs={"0": at})]))

    sync_all()
    clock.t += 6
    sync_all()
    c.evaluate()
    assert list(c.excluded) == ["n1"] and len(looks) == 1
    for _ in range(40):   # the others stay stalled, heard every 1.5 s
        clock.t += 1.5
        sync_all()
        c.evaluate()
    assert len(looks) == 1, "no look while the restart is under way"
    clock.t += 120 - 60
    sync_all()
    c.evaluate()
    assert len(looks) == 2, "past the restart's bound the job is looked at again"


def test_never_below_min_nodes_and_a_silent_node_is_dead():
    c, clock = make(PolicyConfig(min_nodes=2, node_timeout_seconds=3))
    for seq in (1, 2, 3):   # heard steadily: only such a node can fall silent
        clock.t += 0.25
        t = clock.t
        for n in ("n0", "n1"):
            c.sync(summary(n, seq, t, [dict(rank=int(n[1]), step=5, progress_at=t, last_seen=t)]))
    clock.t += 4
    c.sync(summary("n0", 4, clock.t, [dict(rank=0, step=9, progress_at=clock.t, last_seen=clock.t)]))
    c.evaluate()
    assert c.node_states() == {"n0": "ok", "n1": "dead"}
    assert c.excluded == {}, "one node would remain, below --min-nodes 2"



def _ten_nodes_heard_steadily(c, clock, names):
    """Sync every node of ``names`` three times (only a node heard steadily can fall silent);
    returns ``sync(nodes)``, which syncs those nodes once more at the clock's time."""
    seq = 0

    def sync(nodes):
        nonlocal seq
        seq += 1
        for n in nodes:
            c.sync(summary(n, seq, clock.t, [dict(rank=int(n[1]), step=5, progress_at=clock.t,
                                                  last_seen=clock.t)]))

    for _ in range(3):
        clock.t += 0.25
        sync(names)
    return sync


def test_a_burst_of_silent_nodes_is_not_that_many_dead_nodes():
    """Ten nodes; five fall silent together (more than --silent-burst-nodes 4 and 2 %): the
    coordinator excludes none of them for that.  Once four of them are back, the one still
    silent is excluded."""
    c, clock = make(PolicyConfig(node_timeout_seconds=3))
    names = [f"n{i}" for i in range(10)]
    sync = _ten_nodes_heard_steadily(c, clock, names)
    for _ in range(5):
        clock.t += 1
        sync(names[:5])
        c.evaluate()
    assert set(c.node_states().values()) == {"ok"} and c.excluded == {}
    clock.t += 1
    sync(names[:9])   # n5-n8 are back; n9 is still silent
    c.evaluate()
    assert set(c.excluded) == {"n9"}


def test_nodes_falling_silent_one_at_a_time_are_one_burst():
    """Ten nodes fall silent one evaluation apart: a node excluded for its silence counts in
    the burst for --silent-burst-seconds, so four are excluded and the fifth is held; once
    the window has passed, silence is evidence again."""
    c, clock = make(PolicyConfig(node_timeout_seconds=3, silent_burst_seconds=30))
    names = [f"n{i}" for i in range(10)]
    sync = _ten_nodes_heard_steadily(c, clock, names)
    for k in range(11):   # n9, n8, ... n5 stop syncing one second apart; n0-n4 sync on
        clock.t += 1
        sync(names[:max(5, 9 - k)])
        c.evaluate()
    assert set(c.excluded) == {"n9", "n8", "n7", "n6"}, "the fifth in the window is held"
    clock.t += 31   # the window passes; n5 is still silent
    sync(names[:5])
    c.evaluate()
    assert set(c.excluded) == {"n9", "n8", "n7", "n6", "n5"}


def test_ranks_killed_by_a_restart_are_not_a_dead_node_unless_none_come_back():
    c, clock = make(PolicyConfig(min_nodes=1, crashed_grace_seconds=15))
    dead = dict(connected=False, alive=False, exited_cleanly=False)

    def sync_all(seq, n1_ranks):
        c.sync(summary("n0", seq, clock.t, [dict(rank=0, step=5, progress_at=clock.t, last_seen=clock.t)]))
        c.sync(summary("n1", seq, clock.t, n1_ranks))
        c.evaluate()

    sync_all(1, [dict(rank=1, step=5, progress_at=clock.t, last_seen=clock.t, pid=11)])
    clock.t += 4  # torchrun restarts n1's workers: the old rank is gone, no new one yet
    sync_all(2, [dict(rank=1, step=5, pid=11, **dead)])
    clock.t += 5
    sync_all(3, [dict(rank=1, step=5, pid=11, **dead)])
    assert c.excluded == {}
    clock.t += 1  # the new worker connects: the clock starts again
    sync_all(4, [dict(rank=1, step=5, pid=11, **dead), dict(rank=1, step=6, pid=12, progress_at=clock.t,
                                                             last_seen=clock.t)])
    clock.t += 20
    sync_all(5, [dict(rank=1, step=5, pid=12, **dead)])  # that one dies too, and none come back
    assert c.excluded == {}
    clock.t += 16
    sync_all(6, [dict(rank=1, step=5, pid=12, **dead)])
    assert list(c.excluded) == ["n1"] and "all its ranks died" in c.excluded["n1"]


def test_checkpoint_step_is_ahead_of_the_fastest_rank_and_duplicates_merge():
    c, clock = make()
    with pytest.raises(LookupError):
        c.request_checkpoint("nobody")
    t = clock.t
    c.sync(summary("n0", 1, t, [dict(rank=0, step=40, progress_at=t, last_seen=t)]))
    c.sync(summary("n1", 1, t, [dict(rank=1, step=42, progress_at=t, last_seen=t)]))
    d = c.request_checkpoint("operator")
    assert d.step == 42 + 20  # 2 s of 0.1 s steps past the fastest rank
    assert c.request_checkpoint("again") is d


def test_the_coordinator_keeps_a_bounded_number_of_nodes():
    from rankwatch.agent.node.intake import Rejected

    c, _ = make(policy=PolicyConfig(max_nodes=2))
    c.sync(summary("a", 1, 1.0, []))
    c.sync(summary("b", 1, 1.0, []))
    with pytest.raises(Rejected, match="too_many_nodes"):
        c.sync(summary("c", 1, 1.0, []))
    c.sync(summary("a", 2, 1.5, []))   # a known node is still heard
    assert sorted(c.nodes) == ["a", "b"]


def test_stale_or_anonymous_summaries_are_refused():
    c, clock = make()
    c.sync(summary("n0", 5, clock.t, []))
    with pytest.raises(ValueError, match="stale"):
        c.sync(summary("n0", 4, clock.t, []))
    with pytest.raises(ValueError, match="node_id"):
        c.sync(pb.NodeSummary(seq=1))


def test_only_a_fatal_gpu_fault_excludes():
    c, clock = make()
    t = clock.t
    s1 = summary("n1", 1, t, [dict(rank=1, step=5, progress_at=t, last_seen=t)])
    s1.incidents.append(pb.Incident(id="gpu_fault-1", kind="gpu_fault", node="n1", rank=1,
                                    detail_json='{"gpu": 0, "xid": 999, "action": "unknown"}'))
    c.sync(summary("n0", 1, t, [dict(rank=0, step=5, progress_at=t, last_seen=t)]))
    c.sync(s1)
    c.evaluate()
    assert c.excluded == {}
    s1 = summary("n1", 2, t, [dict(rank=1, step=5, progress_at=t, last_seen=t)])
    s1.incidents.append(pb.Incident(id="gpu_fault-2", kind="gpu_fault", node="n1", rank=1,
                                    detail_json='{"gpu": 0, "xid": 79, "action": "reboot"}'))
    c.sync(s1)
    c.evaluate()
    assert "fatal GPU fault" in c.excluded["n1"]


def windows(packed: bool, own: float, comm: float) -> dict:
    """A rank's 16-step windows: packed, as a node agent sends them, or as an older agent's
    repeated doubles."""
    if packed:
        return dict(work=work_windows.pack([own] * 16, [0.0] * 16, [comm] * 16))
    return dict(own_work=[own] * 16, comm_wait=[comm] * 16, data_wait=[0.0] * 16)


# A job of nodes whose agents send the windows packed, of older agents, and of both at once
# (an upgrade under way): the coordinator reads either form alike.
@pytest.mark.parametrize(("n0_packed", "n1_packed"), [(True, True), (False, False), (False, True), (True, False)])
def test_a_costly_straggling_node_is_evicted_after_the_next_checkpoint(n0_packed, n1_packed):
    from rankwatch.agent.detect.straggler import StragglerConfig

    c, clock = make(straggler=StragglerConfig(warmup_steps=0))
    t = clock.t
    for seq in range(1, 200):
        done = 40 + seq
        clock.t = t + seq * 0.1
        c.sync(summary("n0", seq, clock.t, [dict(rank=0, step=done, steps_completed=done,
                                                  progress_at=clock.t, last_seen=clock.t,
                                                  **windows(n0_packed, 0.1, 0.1))]))
        c.sync(summary("n1", seq, clock.t, [dict(rank=1, step=done, steps_completed=done,
                                                  progress_at=clock.t, last_seen=clock.t,
                                                  **windows(n1_packed, 0.2, 0.0))]))
        c.evaluate()
        if eviction_checkpoints(c, "n1"):
            break
    (planned,) = eviction_checkpoints(c, "n1")  # a 2x slower single-rank node is to be evicted
    step = planned.step
    assert c.excluded == {} and [d.kind for d in c.decisions] == ["checkpoint"]
    c.sync(summary("n0", 999, clock.t, [dict(rank=0, step=step - 1, progress_at=clock.t, last_seen=clock.t)]))
    c.evaluate()
    assert c.excluded == {}, "evicted before its checkpoint was complete"
    saved = summary("n0", 1000, clock.t, [dict(rank=0, step=step, progress_at=clock.t, last_seen=clock.t)])
    saved.incidents.append(pb.Incident(id="checkpoint-1", kind="checkpoint", node="n0", rank=0, step=step,
                                       detail_json='{"ok": true}'))
    c.sync(saved)
    c.evaluate()
    assert c.excluded["n1"].startswith("straggler")


def test_a_restart_is_over_only_when_new_workers_step():
    c, clock = make(PolicyConfig(min_nodes=1))
    t = clock.t
    for n in ("n0", "n1"):
        c.sync(summary(n, 1, t, [dict(rank=int(n[1]), step=5, pid=10 + int(n[1]), progress_at=t, last_seen=t)]))
    c.exclude("n1", "test")
    (restart,) = [i for i in c.incidents.items if i.kind == "restart"]
    clock.t += 1  # n0's old worker still steps until the restart stops it
    c.sync(summary("n0", 2, clock.t, [dict(rank=0, step=6, pid=10, progress_at=clock.t, last_seen=clock.t)]))
    c.evaluate()
    assert "recovered_after_seconds" not in c.incidents.get(restart.id).detail
    clock.t += 7  # a new worker (new pid) steps
    c.sync(summary("n0", 3, clock.t, [dict(rank=0, step=6, pid=20, progress_at=clock.t, last_seen=clock.t)]))
    c.evaluate()
    assert c.incidents.get(restart.id).detail["recovered_after_seconds"] == pytest.approx(8, abs=0.01)


def test_a_job_straggler_is_resolved_when_the_node_recovers():
    import json

    from rankwatch.agent.detect.straggler import StragglerConfig

    c, clock = make(PolicyConfig(evict_straggler_speedup=100.0),  # flag only, never evict
                    straggler=StragglerConfig(warmup_steps=0, clear_after=10))
    t, seq = clock.t, 0

    def sync(n1_own: float) -> pb.SyncReply:
        nonlocal seq
        seq += 1
        done = 40 + seq
        clock.t = t + seq * 0.1
        work = dict(steps_completed=done, step=done, progress_at=clock.t, last_seen=clock.t,
                    step_seconds=0.25, comm_wait=[0.0] * 16, data_wait=[0.0] * 16)
        c.sync(summary("n0", seq, clock.t, [dict(rank=0, own_work=[0.1] * 16, **work)]))
        reply = c.sync(summary("n1", seq, clock.t, [dict(rank=1, own_work=[n1_own] * 16, **work)]))
        c.evaluate()
        return reply

    for _ in range(60):
        sync(0.2)
    (inc,) = [i for i in c.incidents.items if i.kind == "straggler"]
    assert (inc.node, inc.rank) == ("n1", 1) and "resolved_at" not in inc.detail
    for _ in range(60):
        sync(0.1)
        inc = c.incidents.get(inc.id)
        if "resolved_at" in inc.detail:
            break
    assert "resolved_at" in inc.detail, "a recovered node's straggler incident is resolved"
    assert c.decisions == [] and c.excluded == {}
    # The node hears it with its next sync (and unmarks its rank: test_agent_grpc).
    (sent,) = [i for i in sync(0.1).incidents if i.kind == "straggler"]
    assert json.loads(sent.detail_json)["resolved_at"] == inc.detail["resolved_at"]
    assert len([i for i in c.incidents.items if i.kind == "straggler"]) == 1


def test_new_workers_whose_steps_count_from_zero_are_watched_at_once():
    """After a restart (or on the next job), the workers' completed steps start again from
    zero: the job's detector runs on them at once, not after the old count."""
    from rankwatch.agent.detect.straggler import StragglerConfig

    c, clock = make(PolicyConfig(evict_straggler_speedup=100.0),  # flag only, never evict
                    straggler=StragglerConfig(warmup_steps=0, clear_after=10))
    t, seq = clock.t, 0

    def sync(done: int, slow: int) -> None:
        nonlocal seq
        seq += 1
        clock.t = t + seq * 0.1
        work = dict(steps_completed=done, step=done, progress_at=clock.t, last_seen=clock.t,
                    step_seconds=0.25, comm_wait=[0.0] * 16, data_wait=[0.0] * 16)
        for rank in (0, 1):
            own = [0.2 if rank == slow else 0.1] * min(done, 16)
            c.sync(summary(f"n{rank}", seq, clock.t, [dict(rank=rank, own_work=own, **work)]))
        c.evaluate()

    for done in range(20, 200):
        sync(done, slow=1)
    assert [i.rank for i in c.incidents.items if i.kind == "straggler"] == [1]
    for done in range(1, 80):   # new workers: rank 0 is the slow one now
        sync(done, slow=0)
    assert [i.rank for i in c.incidents.items if i.kind == "straggler"] == [1, 0]


@pytest.mark.parametrize("sent_period", [True, False])
def test_the_job_straggler_hold_is_counted_in_the_period_the_node_sends(sent_period):
    # Each node's only rank fetches its batch outside its step scope: 5 (n0) and 10 ms (n1)
    # of scope time, 40 ms from step start to step start.  The 2 s hold is 50 of those steps;
    # counted in scope time, it would be 200.  A node that sends no period (an older agent)
    # is held in scope time, as before.
    from rankwatch.agent.detect.straggler import StragglerConfig

    c, clock = make(PolicyConfig(evict_straggler_speedup=100.0),  # flag only, never evict
                    straggler=StragglerConfig(warmup_steps=0))
    assert c.stragglers.cfg.hold_seconds == 2.0
    t = clock.t
    flagged_at = None
    for seq in range(1, 151):
        done = 40 + seq
        clock.t = t + seq * 0.04
        for node, rank, own in (("n0", 0, 0.005), ("n1", 1, 0.010)):
            extra = {"step_period": 0.04} if sent_period else {}
            c.sync(summary(node, seq, clock.t, [dict(rank=rank, step=done, steps_completed=done,
                                                     progress_at=clock.t, last_seen=clock.t,
                                                     step_seconds=own, own_work=[own] * 16,
                                                     comm_wait=[0.0] * 16, data_wait=[0.0] * 16,
                                                     **extra)]))
        c.evaluate()
        if flagged_at is None and any(i.kind == "straggler" for i in c.incidents.items):
            flagged_at = seq
    if sent_period:
        (inc,) = [i for i in c.incidents.items if i.kind == "straggler"]
        assert (inc.node, inc.rank) == ("n1", 1)
        assert flagged_at is not None and 50 <= flagged_at <= 80, flagged_at
    else:
        assert flagged_at is None, f"held in scope time, flagged only after ~200 steps, not {flagged_at}"


def test_the_straggler_inputs_are_read_once_per_whole_summary():
    c, clock = make(PolicyConfig(min_nodes=1))
    t = clock.t

    def sync(node, seq, own, connected=True):
        c.sync(summary(node, seq, clock.t, [dict(rank=int(node[1]), step=seq, steps_completed=seq, connected=connected,
                                                 progress_at=clock.t, last_seen=clock.t, own_work=[own] * 4,
                                                 comm_wait=[0.0] * 4, data_wait=[0.0] * 4, step_period=0.3)]))

    def rows(work):
        return sorted((w.rank, w.node, list(w.own), w.completed, w.step_seconds, w.period) for w in work)

    for n, own in (("n0", 0.1), ("n1", 0.2), ("n2", 0.3)):
        sync(n, 1, own)
    sync("n3", 1, 0.4, connected=False)   # a rank its node no longer hears
    work = c.view.straggler_work(t)
    assert rows(work) == [(0, "n0", [0.1] * 4, 1, 0.1, 0.3), (1, "n1", [0.2] * 4, 1, 0.1, 0.3),
                          (2, "n2", [0.3] * 4, 1, 0.1, 0.3)]
    assert [w.node for w in work] == ["n0", "n1", "n2"]
    clock.t += 0.25
    sync("n1", 2, 0.25)   # a new whole summary: read again; the others are kept as they were
    again = c.view.straggler_work(clock.t)
    assert rows(again)[1] == (1, "n1", [0.25] * 4, 2, 0.1, 0.3)
    assert [w.completed for w in again] == [1, 2, 1] and list(again[1].own) == [0.25] * 4
    assert again[0] is work[0] and again[2] is work[2]
    c.exclude("n2", "test")
    assert [w.node for w in c.view.straggler_work(clock.t)] == ["n0", "n1"]


def test_a_node_heard_once_then_refused_is_not_called_dead():
    # Thousands of nodes joining at once: n1 was heard once, then its syncs failed at the door.
    c, clock = make(PolicyConfig(min_nodes=1, node_timeout_seconds=3))
    for seq in (1, 2, 3):
        clock.t += 0.25
        c.sync(summary("n0", seq, clock.t, [dict(rank=0, step=5, progress_at=clock.t, last_seen=clock.t)]))
        if seq == 1:
            c.sync(summary("n1", 1, clock.t, [dict(rank=1, step=5, progress_at=clock.t, last_seen=clock.t)]))
    clock.t += 10
    c.sync(summary("n0", 4, clock.t, [dict(rank=0, step=9, progress_at=clock.t, last_seen=clock.t)]))
    c.evaluate()
    assert c.node_states()["n1"] != "dead" and c.excluded == {}


def test_an_overloaded_coordinator_acts_only_on_a_hang_its_ranks_report():
    """While the coordinator is in its quiet period after overload, summaries arrive late and a
    training job can look hung to it.  It opens a hang only when the heard ranks' own reports
    show them stalled past the allowance and the culprit is not named for its silence alone."""
    def job(reported, n1_heard=True):
        c, clock = make()
        t = clock.t
        for seq, at in ((1, t), (2, t + reported)):
            clock.t = at
            c.sync(summary("n0", seq, at, [dict(rank=0, step=50, progress_at=t, last_seen=at, group_seqs={"0": 900},
                                                inflight=pb.InFlight(op="all_reduce", group="0", seq=900, since=t))]))
            c.sync(summary("n1", seq, at,    # (a rank whose stream fell silent at its node: last_seen t)
                           [dict(rank=1, step=50, progress_at=t, last_seen=at if n1_heard else t,
                                 group_seqs={"0": 899 if n1_heard else 900})]))
        clock.t = t + 8
        c.load.quiet = clock.t + 60   # the grace after the coordinator's own overload
        c.evaluate()
        return c, clock, [i for i in c.incidents.items if i.kind == "hang"]

    _, _, hangs = job(reported=6.0)   # both ranks said they stood still 6 s (allowance 5 s)
    assert [(h.node, h.rank) for h in hangs] == [("n1", 1)]
    _, _, hangs = job(reported=3.0)   # their last reports came 3 s into the stall: the rest is lag
    assert hangs == []
    c, clock, hangs = job(reported=6.0, n1_heard=False)   # rank 1 silent, its last report not short
    assert hangs == [], "a culprit named for its silence alone waits for the quiet period's end"
    clock.t = c.load.quiet
    c.evaluate()
    assert [(h.node, h.rank) for h in c.incidents.items if h.kind == "hang"] == [("n1", 1)]


def _trickle(others_all_heard: bool, excluded: tuple[str, ...] = ()):
    """20 nodes of one rank each, heard every 0.25 s for 2 s.  Then n18 and n19 fall
    silent, and the others are heard either all (a job that lost two nodes) or two per
    tick in turn (each every 2.25 s, inside the 3 s allowance: the trickle an idle
    coordinator hears when the senders or the network fail most syncs)."""
    clock = Clock()
    c = Coordinator("n0", incidents=IncidentLog(None), policy=PolicyConfig(), clock=clock,
                    load_clocks=(clock, lambda: 0.0))   # its own CPU idle throughout
    names = [f"n{i}" for i in range(20)]
    seq = dict.fromkeys(names, 0)

    def heard(name):
        seq[name] += 1
        i = names.index(name)
        t = clock.t
        c.sync(summary(name, seq[name], t, [dict(rank=i, step=seq[name], progress_at=t, last_seen=t)]))

    for tick in range(8):
        clock.t += 0.25
        for name in names:
            heard(name)
        c.evaluate()
    for name in excluded:
        c.exclude(name, "a fatal GPU fault")
    live = [n for n in names[:18] if n not in excluded]
    for tick in range(60):
        clock.t += 0.25
        for name in live if others_all_heard else [live[(2 * tick) % len(live)], live[(2 * tick + 1) % len(live)]]:
            heard(name)
        c.evaluate()
    return c


def test_an_idle_coordinator_hearing_a_job_wide_trickle_excludes_no_node():
    """Hearing a tenth of what is due, with 18 nodes' worth missing (more than the 4 the burst
    rule takes for dead at once), is the coordinator's or the network's trouble even while
    its CPU idles: each evaluation finds only a node or two past the allowance, under the
    burst rule's size, and would have excluded them one by one."""
    c = _trickle(others_all_heard=False)
    assert c.excluded == {}, c.excluded
    assert c.load.overloaded is not None and "nodes' worth missing" in c.load.overloaded
    # A job whose other nodes are all heard has lost two nodes: those are excluded.
    c = _trickle(others_all_heard=True)
    assert set(c.excluded) == {"n18", "n19"} and c.load.overloaded is None


def test_summaries_are_due_only_from_the_nodes_neither_excluded_nor_dead():
    """Twelve nodes excluded for other reasons stop syncing: their silence is no shortfall.
    (Counted as due, the eight live nodes would be heard at 40 %, 12 nodes' worth missing,
    and the coordinator would hold off every silence verdict for as long as the job runs.)"""
    c = _trickle(others_all_heard=True, excluded=tuple(f"n{i}" for i in range(6, 18)))
    assert c.load.overloaded is None
    assert set(c.excluded) == {f"n{i}" for i in range(6, 20)}   # n18, n19 for their silence


def first_flag(every: int) -> tuple[int | None, set[str]]:
    """Four one-rank nodes at 0.1 s steps, n3 25 % slower; each node's windows reach the
    coordinator whole every ``every`` steps, each node at its own phase (beats between, which
    move none of them).  The step at which a straggler was first flagged, and the nodes flagged."""
    import random

    from rankwatch.agent.node.rankrecord import WORK_WINDOW
    from rankwatch.agent.detect.straggler import StragglerConfig

    c, clock = make(PolicyConfig(min_nodes=1, node_timeout_seconds=600, evict_straggler_speedup=100.0),
                    straggler=StragglerConfig(warmup_steps=0))
    rng = random.Random(7)
    nodes = ["n0", "n1", "n2", "n3"]
    own: dict[str, list[float]] = {n: [] for n in nodes}
    t0, first = clock.t, None
    for step in range(1, 400):
        clock.t = t0 + 0.1 * step
        for i, n in enumerate(nodes):
            own[n].append((0.1 if n == "n3" else 0.08) * (1 + 0.02 * rng.random()))
            if (step + i * every // len(nodes)) % every:
                continue
            w = own[n][-WORK_WINDOW:]
            c.sync(summary(n, step, clock.t, [dict(
                rank=i, step=step, steps_completed=step, progress_at=clock.t, last_seen=clock.t,
                work=work_windows.pack(w, [0.0] * len(w), [0.11 - x for x in w]))]))
        c.evaluate()
        if first is None and any(i.kind == "straggler" for i in c.incidents.items):
            first = step
    return first, {i.node for i in c.incidents.items if i.kind == "straggler"}


def test_a_straggler_is_flagged_from_whole_copies_as_stale_as_the_relays_send_them():
    """Behind relays, a node's windows reach the coordinator whole only every
    ``RelayConfig.whole_every_steps`` steps, so its copies of two nodes are up to that many
    steps apart.  Their 64-step windows still line up: the slow node is flagged, and no other,
    at most that many steps later than from copies fresh at every step."""
    from rankwatch.agent.relays.routing import RelayConfig

    every = RelayConfig().whole_every_steps
    fresh, fresh_flagged = first_flag(1)
    stale, stale_flagged = first_flag(every)
    assert fresh_flagged == stale_flagged == {"n3"}
    assert fresh is not None and stale is not None and stale <= fresh + every


@pytest.mark.parametrize(("cost", "passes"), [(0.3, 4), (0.0, 12)])
def test_a_costly_hang_pass_runs_at_most_a_third_of_the_time(cost, passes):
    """While a hang is possible (the job made no progress for the shortest allowance) the
    detector looks at every tick.  A pass that snapshots every rank and takes 0.3 s (16,384
    ranks on a slow machine) runs every third tick of 0.25 s instead, leaving the gRPC threads
    two thirds of the GIL; a cheap pass, every tick.  (The ranks are in an eval phase, whose
    allowance is long: a hang is possible all along, and no verdict ends the looking.)"""
    mono = [50.0]
    clock = Clock()
    c = Coordinator("n0", incidents=IncidentLog(None), policy=PolicyConfig(node_timeout_seconds=600), clock=clock,
                    load_clocks=(lambda: mono[0], lambda: 0.0))
    snapshot, taken = c.snapshot, []

    def costly(now):
        taken.append(now)
        mono[0] += cost
        return snapshot(now)

    c.snapshot = costly
    t = clock.t
    for seq in range(1, 13):   # from 5 s after the last progress (the floor), 12 ticks of 0.25 s
        clock.t, mono[0] = t + 5 + 0.25 * seq, mono[0] + 0.25
        for n in (1, 2):
            c.sync(summary(f"n{n}", seq, clock.t, [dict(rank=n, step=50, progress_at=t, last_seen=clock.t,
                                                        activity="eval", group_seqs={"0": 900})]))
        c.evaluate()
    assert len(taken) == passes
    assert not [i for i in c.incidents.items if i.kind == "hang"]


def _straggler_passes(cores: float, pass_seconds: float = 0.0) -> tuple[Coordinator, list[float]]:
    """12 s of ticks of a two-node job, the coordinator's process at ``cores``, each straggler
    pass taking ``pass_seconds`` on the clock it times passes with: when the passes ran."""
    mono = [50.0]
    clock = Clock()
    c = Coordinator("n0", incidents=IncidentLog(None), policy=PolicyConfig(node_timeout_seconds=600), clock=clock,
                    load_clocks=(lambda: mono[0], lambda: cores * mono[0]))
    read, ran = c.view.straggler_work, []

    def counted(now):
        ran.append(now)
        mono[0] += pass_seconds
        return read(now)

    c.view.straggler_work = counted
    t = clock.t
    for seq in range(1, 49):
        clock.t, mono[0] = t + 0.25 * seq, mono[0] + 0.25
        for n in (1, 2):
            c.sync(summary(f"n{n}", seq, clock.t, [dict(rank=n, step=seq, progress_at=clock.t, last_seen=clock.t)]))
        c.evaluate()
    return c, ran


@pytest.mark.parametrize("cores,passes", [(0.1, 12), (1.0, 4)])   # (two before the first load window)
def test_an_overloaded_coordinator_runs_its_straggler_pass_every_few_seconds(cores, passes):
    """The straggler pass reads every node's windows again: in a big job's start, a fifth of a
    slow coordinator's time at once a second.  Idle, it runs once a second; saturated (its
    process at a full core), every 5 s (load_policy.straggler_due)."""
    c, ran = _straggler_passes(cores)
    assert (c.load.overloaded is not None) == (cores >= 0.9)
    assert len(ran) == passes


def test_a_slow_straggler_pass_is_spaced_by_what_it_cost():
    """A pass that takes 0.19 s (as 16,384 ranks did) runs 3.8 s apart (at the next tick,
    4 s), not once a second: at most ``straggler_share`` of the coordinator's time
    (load_policy.straggler_due)."""
    c, ran = _straggler_passes(0.1, pass_seconds=0.19)
    assert c.load.overloaded is None
    assert [round(b - a, 2) for a, b in zip(ran, ran[1:])] == [4.0, 4.0]


def test_a_silent_nodes_ranks_end_with_it_and_root_the_survivors_peer_errors(tmp_path):
    """n2 falls silent with ranks 2 and 3.  The survivors' gloo errors are recorded first (n1's
    in its summary, n0's in the coordinator's own log), rooted among themselves; once n2 is
    judged dead, each of its ranks gets a ``node_lost`` exit at its last word, its own root,
    and the survivors' exits are linked to it, in the live view and in the durable file."""
    from rankwatch.agent.durable.incidents import Incident

    log = IncidentLog(tmp_path / "incidents.jsonl")
    c = Coordinator("n0", incidents=log, policy=PolicyConfig(min_nodes=1, node_timeout_seconds=3), clock=Clock())
    clock = c.clock
    peer = {"how": "exception", "type": "RuntimeError", "message": "[pair.cc:589] Connection reset by peer",
            "root_cause": None}

    def sync(node, seq, ranks, incidents=()):
        s = summary(node, seq, clock.t, [dict(rank=r, pid=10 + r, step=30, progress_at=clock.t, last_seen=clock.t)
                                         for r in ranks])
        s.incidents.extend(incidents)
        c.sync(s)

    for seq in (1, 2, 3):
        clock.t += 0.25
        for node, ranks in (("n0", [0]), ("n1", [1]), ("n2", [2, 3])):
            sync(node, seq, ranks)
    heard = clock.t
    clock.t += 0.5   # n2 is gone; the survivors' workers break on it
    n1_exit = Incident(id="rank_exit-n1-1", kind="rank_exit", node="n1", rank=1, step=30, detected_at=clock.t,
                       detail={**peer, "pid": 11, "started_at": heard + 0.1})
    sync("n1", 4, [1], [n1_exit.to_pb()])
    n0_exit = log.add(kind="rank_exit", node="n0", rank=0, step=30, detected_at=clock.t,
                      detail={**peer, "pid": 10, "started_at": heard + 0.05}, tag="n0")
    sync("n0", 4, [0])
    c.evaluate()
    assert c.node_states()["n2"] == "ok" and log.get(n0_exit.id).detail["root_cause"] == n0_exit.id, \
        "before n2 is judged dead, the survivors' exits root among themselves"
    clock.t += 3.5
    sync("n0", 5, [0])
    sync("n1", 5, [1], [n1_exit.to_pb()])
    c.evaluate()
    lost = sorted((i for i in log.items if i.detail.get("how") == "node_lost"), key=lambda i: i.rank)
    assert [(i.node, i.rank, i.step, i.detail["pid"]) for i in lost] == [("n2", 2, 30, 12), ("n2", 3, 30, 13)]
    for i in lost:
        assert i.detail["started_at"] == heard and i.detail["why"] == "its agent went silent"
        assert i.detail["root_cause"] == i.id and i.detail["consequence"] is False
    root = lost[0].id
    assert log.get(n0_exit.id).detail["root_cause"] == root and log.get(n0_exit.id).detail["consequence"] is True
    (seen,) = [i for i in c.job_incidents() if i.id == n1_exit.id]
    assert seen.detail["root_cause"] == root
    on_disk = {i.id: i for i in IncidentLog.replay(tmp_path / "incidents.jsonl")}
    assert on_disk[n0_exit.id].detail["root_cause"] == root
    assert [on_disk[i.id].detail["how"] for i in lost] == ["node_lost", "node_lost"]
    assert [on_disk[i.id].detail["root_cause"] for i in lost] == [i.id for i in lost]
    # The lost node's ranks are recorded once, however long it stays dead.
    clock.t += 5
    c.evaluate()
    assert len([i for i in log.items if i.detail.get("how") == "node_lost"]) == 2
