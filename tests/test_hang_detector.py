"""The hang detector as a pure function: injected time, no sleeping."""

import pytest

from rankwatch.agent.detect.hang_verdict import HangConfig, RankProgress, detect_hang, flight_recorder_evidence

CFG = HangConfig(floor_seconds=5.0, step_multiple=5.0, first_step_seconds=60.0,
                 checkpoint_seconds=300.0, silence_seconds=2.0)


def rank(r, *, progress_at=0.0, last_seen=None, steps=10, step_s=0.1, activity="train",
         seqs=None, inflight=None, connected=True):
    return RankProgress(rank=r, node="n0", step=steps, step_seconds=step_s, steps_completed=steps,
                        activity=activity, progress_at=progress_at,
                        last_seen=last_seen if last_seen is not None else 100.0,
                        connected=connected, group_seqs=seqs or {}, inflight=inflight)


def test_no_hang_within_allowance():
    assert detect_hang(4.9, [rank(0), rank(1)], CFG) is None


def test_one_rank_progressing_means_no_hang():
    assert detect_hang(100.0, [rank(0), rank(1, progress_at=99.0)], CFG) is None


def test_allowance_scales_with_step_time():
    slow = [rank(0, step_s=2.0), rank(1, step_s=2.0)]
    assert detect_hang(9.0, slow, CFG) is None
    assert detect_hang(10.5, slow, CFG) is not None


def test_silent_rank_is_culprit_and_collective_named():
    waiting = {"op": "all_gather", "group": "1", "seq": 42, "since": 0.0}
    v = detect_hang(10.0, [rank(0, last_seen=10.0, inflight=waiting),
                           rank(1, last_seen=1.0),
                           rank(2, last_seen=10.0, inflight=waiting)], CFG)
    assert v.culprit.rank == 1 and v.silent == [1]
    assert v.collective == {"op": "all_gather", "group": "1", "seq": 42, "source": "hooks"}


def test_flight_recorder_names_the_collective_no_hook_saw():
    # A collective issued where no Python hook sees it (C++), so the hooks report nothing in
    # flight; the waiting ranks' Flight Recorder still holds it, not yet retired.
    def fr(seq, since):
        return {"pending": [{"group": "0", "desc": "default_pg", "seq": seq, "op": "all_reduce",
                             "state": "scheduled", "since": since},
                            {"group": "0", "desc": "default_pg", "seq": seq + 1, "op": "broadcast",
                             "state": "scheduled", "since": since + 1}],
                "completed": {"0": seq - 1}, "enqueued": {"0": seq + 1}}
    views = [rank(0, last_seen=10.0), rank(1, last_seen=1.0), rank(2, last_seen=10.0)]
    views[0].flight_recorder, views[2].flight_recorder = fr(7, 3.0), fr(7, 2.0)
    v = detect_hang(10.0, views, CFG)
    assert v.culprit.rank == 1
    assert v.collective == {"op": "all_reduce", "group": "0", "seq": 7, "source": "flight_recorder"}
    assert flight_recorder_evidence(views) == {"0": views[0].flight_recorder, "2": views[2].flight_recorder}
    # The hooks' own record wins where there is one.
    views[0].inflight = {"op": "all_gather", "group": "1", "seq": 4, "since": 0.0}
    assert detect_hang(10.0, views, CFG).collective["source"] == "hooks"


def test_rank_behind_on_sequence_is_culprit():
    v = detect_hang(10.0, [rank(0, last_seen=10, seqs={"g": 9}), rank(1, last_seen=10, seqs={"g": 8}),
                           rank(2, last_seen=10, seqs={"g": 9})], CFG)
    assert v.culprit.rank == 1 and "behind" in v.reason


def test_rank_outside_collective_is_culprit():
    inside = {"op": "all_reduce", "group": "0", "seq": 3, "since": 0.0}
    v = detect_hang(10.0, [rank(0, last_seen=10, inflight=inside), rank(1, last_seen=10),
                           rank(2, last_seen=10, inflight=inside)], CFG)
    assert v.culprit.rank == 1 and "outside" in v.reason


@pytest.mark.parametrize("activity,limit", [("checkpoint", 300.0), ("eval", 600.0)])
def test_phase_allowances(activity, limit):
    ranks = [rank(0, activity=activity, last_seen=limit), rank(1, last_seen=limit)]
    assert detect_hang(limit - 1, ranks, CFG) is None
    assert detect_hang(limit + 1, ranks, CFG) is not None


def test_first_step_warmup_allowance():
    ranks = [rank(0, steps=0, last_seen=50), rank(1, steps=0, last_seen=50)]
    assert detect_hang(50.0, ranks, CFG) is None
    assert detect_hang(61.0, ranks, CFG) is not None


def test_every_process_gone_is_no_hang():
    # torchrun restarts every worker (or they all crashed): no one waits, so no one hangs, and
    # no node may be excluded as a hang's culprit while its new workers start.
    gone = [rank(r, last_seen=1.0, connected=False) for r in range(4)]
    for r in gone:
        r.alive = False
    assert detect_hang(30.0, gone, CFG) is None
    gone[2].alive = None   # its node's agent is silent: the process may be alive and stuck
    assert detect_hang(30.0, gone, CFG) is not None
    gone[2].alive, gone[3].alive = False, True   # one process lives on, stopped or stuck
    assert detect_hang(30.0, gone, CFG) is not None


def test_clean_exits_are_not_hangs():
    r = rank(0, connected=False)
    r.exited_cleanly = True
    assert detect_hang(1000.0, [r], CFG) is None


def test_config_validates():
    with pytest.raises(ValueError, match="floor_seconds"):
        HangConfig(floor_seconds=0)


def test_an_in_process_recovery_has_its_own_allowance():
    # The survivors regroup (and let joiners in) without progress for seconds; the tier marks
    # it, so a recovery slowed by a loaded host is not taken for a hang, up to its allowance.
    cfg = HangConfig(floor_seconds=5.0, recovery_seconds=60.0)
    regrouping = [rank(0, activity="recovery", seqs={"0": 3}), rank(1, activity="recovery", seqs={"0": 1})]
    assert detect_hang(30.0, regrouping, cfg) is None
    assert detect_hang(30.0, [rank(0, seqs={"0": 3}), rank(1, seqs={"0": 1})], cfg) is not None
    v = detect_hang(61.0, regrouping, cfg)
    assert v is not None and v.allowance == 60.0


def test_a_copy_older_than_its_ranks_progress_is_no_evidence_of_being_behind():
    """A coordinator's copy of a node sent before its ranks moved on (only beats said they
    did) shows sequence numbers they have long passed.  The culprit is named once every copy
    is current, or from the copies at hand after ``stale_copy_seconds`` past the allowance."""
    waiting = {"op": "all_reduce", "group": "0", "seq": 31, "since": 3.0}
    job = [rank(0, seqs={"0": 31}, inflight=waiting, progress_at=3.0, last_seen=20.0),
           rank(1, seqs={"0": 30}, progress_at=2.9, last_seen=20.0),          # truly behind
           rank(2, seqs={"0": 25}, progress_at=1.5, last_seen=20.0)]          # an old copy
    job[2].current = False
    assert detect_hang(9.0, job, CFG) is None, "rank 2's old copy would be named: wait for its current one"
    late = detect_hang(3.0 + CFG.floor_seconds + CFG.stale_copy_seconds + 0.1, job, CFG)
    assert late is not None and late.culprit.rank == 2, "past the bound, the copies at hand decide"
    job[2] = rank(2, seqs={"0": 31}, inflight=waiting, progress_at=3.0, last_seen=20.0)
    v = detect_hang(9.0, job, CFG)
    assert v is not None and v.culprit.rank == 1 and "behind" in v.reason


def test_a_rank_holding_up_the_waited_collective_outranks_a_silent_one():
    """A node can look silent because its reports were lost to an overloaded coordinator.  A
    rank still heard, its copy current, inside no collective and short of the one the others
    wait in, holds that collective up whatever the silent rank did: it is named."""
    waiting = {"op": "all_reduce", "group": "0", "seq": 9, "since": 3.0}
    def job(**holder):
        return [rank(0, seqs={"0": 9}, inflight=waiting, progress_at=3.0, last_seen=20.0),
                rank(1, seqs={"0": 9}, inflight=waiting, progress_at=3.0, last_seen=12.0),  # silent
                rank(2, seqs={"0": 9}, inflight=waiting, progress_at=3.0, last_seen=20.0),
                rank(3, **{"seqs": {"0": 8}, "progress_at": 2.9, "last_seen": 20.0, **holder})]
    v = detect_hang(20.0, job(), CFG)
    assert v is not None and v.culprit.rank == 3 and v.silent == [1]
    assert "has not entered the collective they wait in (sequence 9)" in v.reason
    # Without that evidence, the silent rank is named as before: the rank short of the
    # collective but waiting in another one (it may wait on the silent rank there) ...
    other = {"op": "all_gather", "group": "1", "seq": 4, "since": 2.9}
    assert detect_hang(20.0, job(inflight=other), CFG).culprit.rank == 1
    # ... or one that entered it, or one whose copy is not current.
    assert detect_hang(20.0, job(seqs={"0": 9}), CFG).culprit.rank == 1
    old = job()
    old[3].current = False
    assert detect_hang(3.0 + CFG.floor_seconds + CFG.stale_copy_seconds + 0.1, old, CFG).culprit.rank == 1


def test_a_silent_rank_short_of_the_waited_collective_is_named_before_other_silent_ones():
    """When the rank holding the collective up is itself silent (its node's reports lost too),
    its last current copy still shows it short of the collective: it is named, not the rank
    silent longest."""
    waiting = {"op": "all_reduce", "group": "0", "seq": 9, "since": 3.0}
    def job(**holder):
        return [rank(0, seqs={"0": 9}, inflight=waiting, progress_at=3.0, last_seen=20.0),
                rank(1, seqs={"0": 9}, inflight=waiting, progress_at=3.0, last_seen=11.0),  # silent longest
                rank(2, seqs={"0": 9}, inflight=waiting, progress_at=3.0, last_seen=20.0),
                rank(3, **{"seqs": {"0": 8}, "progress_at": 2.9, "last_seen": 14.0, **holder})]
    v = detect_hang(20.0, job(), CFG)
    assert v is not None and v.culprit.rank == 3 and v.silent == [1, 3]
    assert "went silent" in v.reason and "short of the collective they wait in" in v.reason
    assert detect_hang(20.0, job(seqs={"0": 9}), CFG).culprit.rank == 1, "it had entered it"
    old = job()
    old[3].current = False
    assert detect_hang(20.0, old, CFG).culprit.rank == 1, "its copy is older than its progress"


def test_a_verdict_says_how_long_the_heard_ranks_reported_themselves_stalled():
    """``reported_for`` is the ranks' own account (last message less last progress), not the
    detector's clock less their progress, which grows with any lag before the reports arrive."""
    waiting = {"op": "all_reduce", "group": "0", "seq": 9, "since": 3.0}
    job = [rank(0, seqs={"0": 9}, inflight=waiting, progress_at=3.0, last_seen=9.5),
           rank(1, seqs={"0": 9}, inflight=waiting, progress_at=2.0, last_seen=10.0),
           rank(2, seqs={"0": 8}, progress_at=2.5, last_seen=10.0)]
    v = detect_hang(11.0, job, CFG)
    assert v is not None and v.stalled_for == 8.0 and v.reported_for == 6.5 and not v.by_silence
    job[2].last_seen = 1.0   # silent, and its last report was before the stall
    v = detect_hang(11.0, job, CFG)
    assert v.culprit.rank == 2 and v.reported_for == 6.5 and not v.by_silence, "short of it: its own report"
    job[2].group_seqs = {"0": 9}
    v = detect_hang(11.0, job, CFG)
    assert v.culprit.rank == 2 and v.by_silence, "named for its silence alone"
    assert detect_hang(11.0, [rank(0, last_seen=1.0), rank(1, last_seen=1.5)], CFG).reported_for == 0.0


def test_behind_on_sequence_in_a_job_of_many_groups():
    """A world group, a tensor-parallel group per node of 8 and 8 data-parallel groups (the
    detector reads every group's members in one pass): the largest gap is named; on a tie,
    the first group by name, then the first rank."""
    def job(gaps):
        ranks = []
        for r in range(64):
            seqs = {"world": 50, f"tp{r // 8}": 70, f"dp{r % 8}": 90}
            for (who, group), gap in gaps.items():
                if who == r:
                    seqs[group] -= gap
            ranks.append(rank(r, last_seen=10.0, seqs=seqs))
        return ranks
    v = detect_hang(10.0, job({(37, "dp5"): 2, (12, "tp1"): 2}), CFG)
    assert v.culprit.rank == 37 and v.reason.endswith("group dp5"), "a tie: dp5 sorts before tp1"
    v = detect_hang(10.0, job({(37, "dp5"): 2, (12, "tp1"): 3}), CFG)
    assert v.culprit.rank == 12 and v.reason.endswith("group tp1")
    v = detect_hang(10.0, job({(5, "dp5"): 1, (13, "dp5"): 1}), CFG)
    assert v.culprit.rank == 5, "a tie within a group: the first rank"


def test_the_waited_collective_is_the_one_most_ranks_wait_in():
    def waits(group, seq):
        return {"op": "all_reduce", "group": group, "seq": seq, "since": 0.0}
    ranks = [rank(r, last_seen=10.0, inflight=waits(f"tp{r // 2}", 7)) for r in range(6)]
    ranks += [rank(6, last_seen=10.0, inflight=waits("tp1", 7))]
    assert detect_hang(10.0, ranks, CFG).collective["group"] == "tp1"
    ranks[-1].inflight = waits("tp9", 7)
    assert detect_hang(10.0, ranks, CFG).collective["group"] == "tp0", "a tie: the first seen"


def test_who_runs_the_hang_detector():
    from rankwatch.agent.detect.hang_side import hang_side

    assert hang_side(coordinator=True, covered=False) == "job"
    assert hang_side(coordinator=True, covered=True) == "job"
    assert hang_side(coordinator=False, covered=True) == "deferred"
    assert hang_side(coordinator=False, covered=False) == "node"   # no coordinator, or a silent one
