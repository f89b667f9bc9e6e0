"""The straggler detector as a pure function over per-step own work: no processes, no sleeping."""

from __future__ import annotations

import math
import random
import shutil
from pathlib import Path

import numpy as np
import pytest

from rankwatch.agent.node.starvation import StarvationTracker, critical_run_delays
from rankwatch.agent.detect.straggler import RankWork, StragglerConfig, StragglerDetector, cost_ratio, score
from rankwatch.agent.detect.step_window import loo_median as _loo_median

CFG = StragglerConfig(warmup_steps=0, hold_seconds=1.0)  # the mechanism at a 1 s hold (the default is longer)
N = 64  # steps the agent keeps per rank


def work(rank, own, data=None, node="n0", step_s=0.1, delay=None, start=None, gap=None, comm_delay=None):
    n = len(own)
    return RankWork(rank=rank, node=node, step=n, own=list(own[-N:]),
                    data=list((data if data is not None else [0.001] * n)[-N:]),
                    wait=[0.0] * min(n, N), step_seconds=step_s, completed=n,
                    delay=None if delay is None else list(delay[-N:]),
                    start=None if start is None else list(start[-N:]),
                    gap=None if gap is None else list(gap[-N:]),
                    comm_delay=None if comm_delay is None else list(comm_delay[-N:]))


def noisy(rng, n, base=0.05, jitter=0.05):
    # Multiplicative noise plus occasional contention bursts (time only ever added).
    return [base * (1 + rng.uniform(-jitter, jitter)) + (base * 0.5 if rng.random() < 0.05 else 0)
            for _ in range(n)]


def feed(detector, series, nodes=None, data=None, every=1):
    """Feed step by step (``every`` steps per update); return the events with their step."""
    events = []
    for t in range(every, len(series[0]) + 1, every):
        ranks = [work(r, s[:t], None if data is None else data[r][:t],
                      node=(nodes or {}).get(r, "n0")) for r, s in enumerate(series)]
        events += [(t, ev) for ev in detector.update(ranks, t)]
    return events


def first_flags(events):
    out = {}
    for t, ev in events:
        if ev.kind == "flagged":
            for rank in ev.ranks:
                out.setdefault(rank, (t, ev))
    return out


def test_leave_one_out_median_matches_brute_force():
    rng = np.random.default_rng(0)
    for ranks in range(2, 10):
        x = rng.random((ranks, 7))
        want = np.array([np.median(np.delete(x, i, axis=0), axis=0) for i in range(ranks)])
        np.testing.assert_allclose(_loo_median(x), want)


def test_two_ranks_compared_leave_one_out():
    s = {x.rank: x for x in score([work(0, [0.1] * 16), work(1, [0.125] * 16)], CFG)}
    assert s[1].slowdown == pytest.approx(1.25) and s[0].slowdown == pytest.approx(0.8)
    # The job steps at rank 1's 0.125 s; without its 25 ms, at the other's 0.1 s.
    assert s[1].cause == "compute" and s[1].speedup == pytest.approx(0.125 / 0.1)
    assert s[1].node == "n0" and s[1].excess_seconds == pytest.approx(0.025)


def test_data_cause():
    s = {x.rank: x for x in score([work(0, [0.1] * 16), work(1, [0.15] * 16, data=[0.051] * 16)], CFG)}
    assert s[1].cause == "data"


def test_host_cause_from_run_delay():
    own = [[0.1] * 16, [0.1] * 16, [0.13] * 16]
    delay = [[0.002] * 16, [0.002] * 16, [0.025] * 16]
    s = {x.rank: x for x in score([work(r, own[r], delay=delay[r]) for r in range(3)], CFG)}
    assert s[2].cause == "host" and s[2].slowdown == pytest.approx(1.3)


def test_a_starved_ranks_collective_threads_count_in_its_excess_and_cost():
    # Rank 1 gets 3 % of a core: its own work is 1.5x the others' (6 ms against 4), its
    # training thread waits 1.5 ms a step for a CPU, its gloo threads 288 ms, and every
    # rank's step takes 300 ms.
    own = [[0.004] * 16, [0.006] * 16, [0.004] * 16]
    delay = [[0.0005] * 16, [0.0015] * 16, [0.0005] * 16]
    comm = [[0.001] * 16, [0.289] * 16, [0.001] * 16]

    def scores():
        ranks = [work(r, own[r], delay=delay[r], comm_delay=comm[r], step_s=0.3) for r in range(3)]
        return {x.rank: x for x in score(ranks, CFG)}

    s = scores()
    assert s[1].cause == "host"
    assert s[1].excess_seconds == pytest.approx(0.002 + 0.288)
    assert s[1].slowdown == pytest.approx((0.004 + 0.29) / 0.004)
    assert cost_ratio([s[1]], 0.3) == pytest.approx(30.0)
    assert s[0].excess_seconds <= 0 and s[0].cause == "compute"   # the others are not starved
    # Run delay beyond the step less the others' own work is not the job's (a collective
    # thread can wait while the training thread computes): the excess stops there.
    comm[1] = [0.5] * 16
    assert scores()[1].excess_seconds == pytest.approx(0.296)
    # A busy training thread, not a starved one (rank 1 computes 50 % longer and its gloo
    # threads wait beside it): compute, and its collective threads' waits are not counted.
    delay[1] = [0.0005] * 16
    s = scores()
    assert s[1].cause == "compute" and s[1].excess_seconds == pytest.approx(0.002)
    assert s[1].slowdown == pytest.approx(1.5)


def test_communication_cause_from_late_starts():
    # Rank 2's own work is normal, but it leaves its collectives 30 ms late: its steps
    # start after the others' by that much, every step.
    starts = [[t * 0.15 + (0.03 if r == 2 else 0.0) for t in range(16)] for r in range(3)]
    s = {x.rank: x for x in score([work(r, [0.1] * 16, start=starts[r]) for r in range(3)], CFG)}
    assert s[2].cause == "communication" and s[2].slowdown == pytest.approx(1.3)
    assert s[2].excess_seconds == pytest.approx(0.03)
    assert s[0].cause == "compute" and s[0].slowdown == pytest.approx(1.0)


def test_a_slow_loader_outside_the_step_scope_is_data():
    # `for n, batch in enumerate(loader): with mon.step(n):` -- rank 2's loader takes 30 ms
    # more, between its step scopes: its steps start that much late, as with a slow link, but
    # the late start is its own time between steps, not a collective it left late.
    starts = [[t * 0.15 + (0.03 if r == 2 else 0.0) for t in range(16)] for r in range(3)]
    gaps = [[0.002 + (0.03 if r == 2 else 0.0)] * 16 for r in range(3)]
    s = {x.rank: x for x in score([work(r, [0.1] * 16, start=starts[r], gap=gaps[r]) for r in range(3)], CFG)}
    assert s[2].cause == "data" and s[2].slowdown == pytest.approx(1.3)
    # The same late starts with the same time between steps as the others: communication.
    even = [[0.002] * 16] * 3
    s = {x.rank: x for x in score([work(r, [0.1] * 16, start=starts[r], gap=even[r]) for r in range(3)], CFG)}
    assert s[2].cause == "communication"


def test_late_collectives_are_flagged_as_communication():
    # Rank 2 leaves its collectives 25 ms late from step 60 on (its own work stays normal):
    # every step of it starts that much after the others'.
    rng = random.Random(6)
    onset, n = 60, 140
    own = [noisy(rng, n) for _ in range(4)]
    starts = [[t * 0.1 + (0.025 if r == 2 and t >= onset else 0.0) for t in range(n)] for r in range(4)]
    det, events = StragglerDetector(CFG), []
    for t in range(1, n + 1):
        ranks = [work(r, own[r][:t], start=starts[r][:t]) for r in range(4)]
        events += [(t, ev) for ev in det.update(ranks, t) if ev.kind == "flagged"]
    assert [(ev.ranks, ev.score.cause) for _, ev in events] == [([2], "communication")]
    assert events[0][0] - onset <= 20 and events[0][1].score.slowdown == pytest.approx(1.5, rel=0.15)


def test_host_cause_needs_more_evidence():
    rng = random.Random(8)
    onset, n = 60, 200
    own = [noisy(rng, n) for _ in range(4)]
    own[1] = [x + (0.02 if t >= onset else 0.0) for t, x in enumerate(own[1])]
    delay = [[0.001 + (0.018 if r == 1 and t >= onset else 0.0) for t in range(n)] for r in range(4)]
    det, flagged = StragglerDetector(CFG), None
    for t in range(1, n + 1):
        for ev in det.update([work(r, own[r][:t], delay=delay[r][:t]) for r in range(4)], t):
            flagged = flagged or (t, ev)
    t, ev = flagged
    assert ev.score.cause == "host" and ev.ranks == [1]
    # 40% slower: compute would be confirmed after ~6 steps, host needs host_evidence
    assert 15 <= t - onset <= 40


def test_gpu_health_cause_only_for_slowing_throttles():
    ranks = [work(0, [0.1] * 16), work(1, [0.1] * 16), work(2, [0.12] * 16)]
    hot = {2: ["hw_thermal_slowdown", "gpu_idle"]}
    s = {x.rank: x for x in score(ranks, CFG, gpu_throttle=lambda r: hot.get(r, []))}
    assert s[2].cause == "gpu_health"
    s = {x.rank: x for x in score(ranks, CFG, gpu_throttle=lambda r: ["gpu_idle", "sync_boost"])}
    assert s[2].cause == "compute"


# "within" includes hold_seconds (1 s: 10 steps of 0.1 s here).
@pytest.mark.parametrize("slow,within", [(0.25, 27), (0.5, 19), (0.10, 60)])
def test_slowdown_flagged_quickly(slow, within):
    rng = random.Random(1)
    onset, n = 60, 160
    series = [noisy(rng, n) for _ in range(8)]
    series[3] = [x * (1 + slow) if t >= onset else x for t, x in enumerate(series[3])]
    flagged = first_flags(feed(StragglerDetector(CFG), series))
    assert set(flagged) == {3}
    step, ev = flagged[3]
    assert step - onset <= within and ev.score.slowdown == pytest.approx(1 + slow, rel=0.1)
    assert ev.scope == "rank" and ev.ranks == [3] and ev.detail(16)["cause"] == "compute"


def test_batched_updates_flag_as_fast():
    # The agent evaluates a few times a second: several steps arrive per update.
    rng = random.Random(2)
    onset, n = 60, 160
    series = [noisy(rng, n) for _ in range(4)]
    series[1] = [x * 1.25 if t >= onset else x for t, x in enumerate(series[1])]
    step, _ = first_flags(feed(StragglerDetector(CFG), series, every=7))[1]
    assert step - onset <= 27 + 7   # as fast as one step at a time (test above), plus a batch


def test_no_false_positive_on_20k_steps_of_noise():
    rng = random.Random(7)
    det = StragglerDetector(CFG)
    own = [[] for _ in range(8)]
    for t in range(1, 20_001):
        for r in range(8):
            own[r] += noisy(rng, 1)
            del own[r][:-N]
        ranks = [RankWork(rank=r, node="n0", step=t, own=list(o), data=[0.001] * len(o),
                          wait=[0.0] * len(o), step_seconds=0.1, completed=t) for r, o in enumerate(own)]
        assert not det.update(ranks, t), f"false positive at step {t}"


def test_hysteresis_no_flapping():
    rng = random.Random(3)
    n = 400
    series = [noisy(rng, n) for _ in range(4)]
    clean = [list(s) for s in series]
    # Rank 2 hovers around the threshold after step 50: flagged once, never cleared.
    series[2] = [x * (1.10 if (t // 5) % 2 else 1.06) if t >= 50 else x for t, x in enumerate(series[2])]
    events = feed(StragglerDetector(CFG), series)
    assert [(ev.kind, ev.ranks) for _, ev in events] == [("flagged", [2])]
    assert events[0][0] >= 50
    # The same noise without the slow rank: nothing at all.
    assert feed(StragglerDetector(CFG), clean) == []


def test_hysteresis_keeps_a_flag_between_the_two_thresholds():
    # Rank 1 is 30 % slow, then only 5 % slow: under the flag threshold (8 %) but over the
    # clear threshold (3 %).  The flag stays; it is neither lifted nor raised again.  (With
    # one threshold for both, this rank is cleared at step 151.)
    rng = random.Random(3)
    n = 400
    series = [noisy(rng, n) for _ in range(4)]
    series[1] = [x * 1.3 if 50 <= t < 100 else x * 1.05 if t >= 100 else x for t, x in enumerate(series[1])]
    events = feed(StragglerDetector(CFG), series)
    assert [(ev.kind, ev.ranks) for _, ev in events] == [("flagged", [1])]
    assert 50 <= events[0][0] <= 70


def test_cleared_after_recovery():
    n = 200
    series = [[0.05] * n for _ in range(3)]
    series[1] = [0.08 if 20 <= t < 100 else 0.05 for t in range(n)]
    events = feed(StragglerDetector(CFG), series)
    assert [ev.kind for _, ev in events] == ["flagged", "cleared"]
    cleared_at = events[1][0]
    assert 100 + CFG.clear_after <= cleared_at <= 100 + CFG.clear_after + CFG.window


def test_the_straggler_moves_and_two_ranks_are_never_flagged_together():
    n = 260
    series = [[0.05 if 20 <= t < 110 else 0.08 if t >= 110 else 0.05 for t in range(n)],
              [0.08 if 20 <= t < 110 else 0.05 for t in range(n)]]
    events = feed(StragglerDetector(CFG), series)
    flagged, together = set(), []
    kinds = []
    for t, ev in events:
        ranks = set(ev.ranks or [ev.score.rank])
        flagged = flagged | ranks if ev.kind == "flagged" else flagged - ranks
        kinds.append((ev.kind, sorted(ranks)))
        if len(flagged) > 1 and not any(e.kind == "cleared" for u, e in events if u == t):
            together.append(t)
    assert kinds[:3] == [("flagged", [1]), ("flagged", [0]), ("cleared", [1])]
    assert together == []
    cleared_1 = next(t for t, ev in events if ev.kind == "cleared")
    # At the reversal (once rank 0 has held its slowdown for hold_seconds), not clear_after
    # steps later.
    assert cleared_1 < 110 + CFG.window + math.ceil(CFG.hold_seconds / 0.08) < 110 + CFG.clear_after


def test_whole_node_is_one_node_level_straggler():
    rng = random.Random(4)
    onset, n = 60, 140
    nodes = {r: "n0" if r < 4 else "n1" for r in range(8)}
    series = [noisy(rng, n) for _ in range(8)]
    for r in range(4, 8):  # every rank of n1, e.g. a thermally throttled node
        series[r] = [x * 1.3 if t >= onset else x for t, x in enumerate(series[r])]
    events = [(t, ev) for t, ev in feed(StragglerDetector(CFG), series, nodes=nodes) if ev.kind == "flagged"]
    assert len(events) == 1, [(t, ev.scope, ev.ranks) for t, ev in events]
    t, ev = events[0]
    assert ev.scope == "node" and ev.work.node == "n1" and ev.ranks == [4, 5, 6, 7]
    assert t - onset <= 20 + CFG.node_grace and ev.detail(16)["scope"] == "node"


def test_one_slow_rank_of_a_multi_node_job_is_reported_alone():
    rng = random.Random(5)
    onset, n = 60, 140
    nodes = {r: "n0" if r < 4 else "n1" for r in range(8)}
    series = [noisy(rng, n) for _ in range(8)]
    series[6] = [x * 1.3 if t >= onset else x for t, x in enumerate(series[6])]
    events = [(t, ev) for t, ev in feed(StragglerDetector(CFG), series, nodes=nodes) if ev.kind == "flagged"]
    assert [(ev.scope, ev.ranks, ev.work.node) for _, ev in events] == [("rank", [6], "n1")]
    assert events[0][0] - onset <= 20


def test_a_rank_that_leaves_is_no_longer_flagged():
    series = [[0.05] * 120 for _ in range(3)]
    series[2] = [0.08] * 120
    det = StragglerDetector(CFG)
    first_flags(feed(det, series))
    assert set(det.flagged) == {2}
    det.update([work(r, series[r] + [0.05]) for r in (0, 1)], 121)
    assert not det.flagged and det.cost_ratio(0.1) == 1.0


def test_cost_ratio_is_the_largest_excess():
    base = score([work(0, [0.1] * 16), work(1, [0.1] * 16), work(2, [0.15] * 16), work(3, [0.12] * 16)], CFG)
    flagged = [s for s in base if s.rank in (2, 3)]
    assert cost_ratio(flagged, 0.2) == pytest.approx(0.2 / (0.2 - 0.05))
    assert cost_ratio([], 0.2) == 1.0


def test_config_errors_name_the_knob():
    with pytest.raises(ValueError, match="window"):
        StragglerConfig(window=2)
    with pytest.raises(ValueError, match="evidence"):
        StragglerConfig(evidence=0)
    with pytest.raises(ValueError, match="clear_threshold"):
        StragglerConfig(threshold=0.05, clear_threshold=0.1)


def _thread(proc: Path, pid: int, tid: int, name: str, delay_ns: int) -> None:
    task = proc / str(pid) / "task" / str(tid)
    task.mkdir(parents=True, exist_ok=True)
    (task / "comm").write_text(name + "\n")
    (task / "schedstat").write_text(f"123456 {delay_ns} 7\n")


def test_starvation_tracker_spreads_run_delay_over_steps(tmp_path: Path):
    proc = tmp_path / "proc"

    def schedstat(delay_ns):
        _thread(proc, 42, 42, "python3", delay_ns)

    t = StarvationTracker(maxlen=8, proc=proc)
    schedstat(1_000_000)
    t.sample(0, 42, 10)
    assert t.per_step(0) is None
    schedstat(7_000_000)
    t.sample(0, 42, 13)           # 6 ms over 3 steps
    t.sample(0, 42, 13)           # no step finished: nothing added
    schedstat(9_000_000)
    t.sample(0, 42, 14)
    assert t.per_step(0) == pytest.approx([0.002, 0.002, 0.002, 0.002])
    shutil.rmtree(proc / "42")
    t.sample(0, 42, 15)           # process gone: what was measured stays
    assert len(t.per_step(0)) == 4
    t.sample(0, 43, 1)            # a new process for the rank starts over
    assert critical_run_delays(43, proc) is None and len(t.per_step(0)) == 4


def test_starvation_counts_the_collective_threads_apart_and_not_the_others(tmp_path: Path):
    # The training thread (the leader) and gloo's threads are what a step waits for; an
    # intra-op worker's or the hooks' sender's waits are not.  A thread that began or ended
    # between two samples adds nothing to that sample.
    proc = tmp_path / "proc"
    threads = {42: "python3", 43: "gloo_tcp_loop", 44: "pt_gloo_runloop", 45: "python3", 46: "rankwatch-send"}
    for tid, name in threads.items():
        _thread(proc, 42, tid, name, 1_000_000)
    t = StarvationTracker(maxlen=8, proc=proc)
    t.sample(0, 42, 10)
    for tid, name in threads.items():
        _thread(proc, 42, tid, name, 5_000_000)   # every thread waited 4 ms more
    _thread(proc, 42, 47, "pt_gloo_runloop", 90_000_000)   # new since the last sample
    t.sample(0, 42, 12)
    assert t.per_step(0) == pytest.approx([0.002, 0.002])             # the training thread
    assert t.collective_per_step(0) == pytest.approx([0.004, 0.004])  # 2 threads x 4 ms / 2 steps
    shutil.rmtree(proc / "42" / "task" / "43")                        # one ended
    _thread(proc, 42, 47, "pt_gloo_runloop", 92_000_000)
    _thread(proc, 42, 44, "pt_gloo_runloop", 6_000_000)
    t.sample(0, 42, 13)
    assert t.collective_per_step(0)[-1] == pytest.approx(0.003)       # 44 +1 ms, 47 +2 ms
    assert t.per_step(0)[-1] == 0.0
    # A rank the node no longer has is forgotten, whatever it kept.
    t.sample(1, 42, 13)
    t.retain({1})
    assert t.per_step(0) is None and t.collective_per_step(0) is None
    assert set(t._last) == set(t._names) == set(t._per_step) == {1}


def test_run_delay_of_this_process_is_readable():
    pid = __import__("os").getpid()
    delays = critical_run_delays(pid)
    assert delays is not None and pid in delays


def test_agent_flags_set_the_config():
    from rankwatch.agent.cli.app import _straggler_config, build_parser

    args = build_parser().parse_args(["agent", "--straggler-threshold", "0.02", "--straggler-window", "24",
                                      "--straggler-evidence", "3"])
    cfg = _straggler_config(args)
    assert (cfg.threshold, cfg.clear_threshold, cfg.window, cfg.evidence) == (0.02, 0.02, 24, 3.0)
    assert _straggler_config(build_parser().parse_args(["agent"])) == StragglerConfig()
    with pytest.raises(ValueError, match="window"):
        _straggler_config(build_parser().parse_args(["agent", "--straggler-window", "2"]))


@pytest.mark.parametrize("base,flagged", [(0.003, False), (0.03, True)])
def test_an_excess_below_the_hosts_noise_is_not_a_straggler(base, flagged):
    # The same 30 % on a 3 ms step (0.9 ms a step: a shared CPU's scheduling noise) and on a
    # 30 ms one (9 ms a step).
    det, events = StragglerDetector(CFG), []
    for t in range(1, 121):
        own = [[base] * t, [base] * t, [base * (1.3 if s >= 60 else 1.0) for s in range(t)]]
        events += [ev for ev in det.update([work(r, own[r]) for r in range(3)], t) if ev.kind == "flagged"]
    assert [ev.ranks or [ev.score.rank] for ev in events] == ([[2]] if flagged else [])


def test_steps_that_start_unevenly_flag_no_one():
    # A TP/FSDP job on millisecond steps: no collective spans the step boundary (each rank runs
    # its optimizer alone), so every step some ranks start 0-2 ms after others, at random.  The
    # late start counts for whoever is late, and the others' late starts count for them: noise.
    # Own work as measured on such a job on a shared 2-core host: 5 ms, one step in five up to
    # 12 ms more (the rank waited for a CPU).
    rng = random.Random(3)
    n = 1000
    own = [[0.005 + (rng.uniform(0, 0.012) if rng.random() < 0.2 else 0.0) for _ in range(n)]
           for _ in range(4)]
    starts = [[t * 0.02 + rng.uniform(0, 0.002) for t in range(n)] for _ in range(4)]
    det = StragglerDetector(CFG)
    for t in range(1, n + 1):
        ranks = [work(r, own[r][:t], step_s=0.02, start=starts[r][:t]) for r in range(4)]
        assert not [ev for ev in det.update(ranks, t) if ev.kind == "flagged"], f"flagged at step {t}"
    # Late starts added to one side only: every rank's CUSUM grew by ~0.1 a step (to 20-30 here).
    assert max(det._cusum.values()) < CFG.evidence


def test_a_host_slowdown_first_read_as_compute_still_needs_host_evidence():
    # Rank 1 is 30 % slower from step 60; its run delay (CPU starvation) shows from step 68 on
    # (the agent samples it now and then), after the CUSUM has confirmed a compute slowdown.
    # By the time the hold is over the cause is host, and host needs host_evidence.
    cfg = StragglerConfig(warmup_steps=0, hold_seconds=1.5)  # 15 steps of 0.1 s
    onset, n = 60, 160
    own = [[0.05] * n for _ in range(4)]
    own[1] = [0.05 * (1.3 if t >= onset else 1.0) for t in range(n)]
    delay = [[0.001 + (0.015 if r == 1 and t >= onset + 8 else 0.0) for t in range(n)] for r in range(4)]
    det, events = StragglerDetector(cfg), []
    for t in range(1, n + 1):
        events += [(t, ev) for ev in det.update([work(r, own[r][:t], delay=delay[r][:t]) for r in range(4)], t)]
    assert [(ev.kind, ev.ranks, ev.score.cause) for _, ev in events] == [("flagged", [1], "host")]
    t, ev = events[0]
    assert ev.score.evidence >= cfg.host_evidence, (t, ev.score)


def test_the_cost_of_excess_outside_the_step_scope_stays_finite():
    # A loader fetched between step scopes adds 300 ms to 100 ms steps: the excess is larger
    # than the step time the scope measured, and the job would step about 4x faster without it
    # (it read 10^7 when the step time alone was the yardstick).
    starts = [[t * 0.4 + (0.3 if r == 2 else 0.0) for t in range(16)] for r in range(3)]
    gaps = [[0.002 + (0.3 if r == 2 else 0.0)] * 16 for r in range(3)]
    s = {x.rank: x for x in score([work(r, [0.1] * 16, start=starts[r], gap=gaps[r]) for r in range(3)], CFG)}
    assert s[2].cause == "data"
    assert s[2].speedup == pytest.approx((0.1 + 0.3) / 0.1, rel=0.05)


class _ScoresEveryone(StragglerDetector):
    """The reference: every rank scored at each evaluation (what the detector did before it
    scored only the ranks whose scores can change a flag)."""

    def _candidates(self, full):
        return list(range(len(full)))


def _events_key(events):
    return [(t, ev.kind, ev.scope, ev.score.rank, tuple(ev.ranks), ev.score.cause,
             round(ev.score.slowdown, 12), round(ev.score.evidence, 12)) for t, ev in events]


@pytest.mark.parametrize("seed", range(6))
def test_scoring_only_the_candidates_changes_no_event(seed):
    """Random jobs of 4 nodes x 4 ranks with a slow rank and a slow node (its ranks slowing a
    few steps apart) that come and go, fed
    a few steps at a time: the detector raises and lifts exactly the flags, at the same steps,
    with the same scores, as one that scores every rank at each evaluation."""
    rng = random.Random(seed)
    ranks, steps = 16, 420
    series = [noisy(rng, steps) for _ in range(ranks)]
    nodes = {r: f"n{r // 4}" for r in range(ranks)}
    slow_rank, slow_node = rng.randrange(ranks), rng.randrange(4)
    for t in range(100, 220):
        series[slow_rank][t] *= 1.35
    for k, r in enumerate(range(slow_node * 4, slow_node * 4 + 4)):   # its ranks slow one by one
        for t in range(250 + rng.randrange(12) * k, 360):
            series[r][t] *= 1.25
    every = rng.choice((1, 2, 3))
    # No hold: a rank confirmed first waits node_grace steps for its node's other ranks only
    # while they are slow too, which needs their scores before they have the evidence.
    cfg = StragglerConfig(warmup_steps=0, hold_seconds=0.0)
    got = feed(StragglerDetector(cfg), series, nodes, every=every)
    want = feed(_ScoresEveryone(cfg), series, nodes, every=every)
    assert _events_key(got) == _events_key(want)
    assert any(ev.kind == "flagged" for _, ev in got) and any(ev.kind == "cleared" for _, ev in got)
    assert any(ev.scope == "node" for _, ev in got)


def test_two_short_bursts_do_not_add_up_to_a_held_slowdown():
    # Rank 1 is 50 % slower for 9 steps at step 100 and again at step 200 (0.1 s steps, so
    # each burst is confirmed for well under the 1 s hold).  Between them every CUSUM falls
    # below the evidence; the first burst's confirmation must end there, or the second burst
    # is flagged the moment it is confirmed, as if it had held since step 108.
    n = 300
    own = [[0.05] * n for _ in range(4)]
    own[1] = [0.075 if 100 <= t < 109 or 200 <= t < 209 else 0.05 for t in range(n)]
    det = StragglerDetector(CFG)
    confirmed = []
    for t in range(1, n + 1):
        flags = [ev for ev in det.update([work(r, own[r][:t]) for r in range(4)], t) if ev.kind == "flagged"]
        assert not flags, f"flagged at step {t}: {flags[0].score}"
        if det._ready:
            confirmed.append(t)
    # Both bursts were confirmed (the test would pass vacuously otherwise), each briefly.
    assert any(100 < t < 120 for t in confirmed) and any(200 < t < 220 for t in confirmed), confirmed
    assert len(confirmed) < 2 * math.ceil(CFG.hold_seconds / 0.1), confirmed


def test_the_hold_is_counted_start_to_start_when_time_goes_outside_the_step_scope():
    # Rank 2 fetches its batch before its 4 ms step scope opens, 30 ms from step 60: the job
    # steps every 35 ms, though each scope lasts 5 ms.  The 1 s hold is 29 of those steps; in
    # scope time it would be 200, and the rank would be flagged only after step 260.
    n, onset = 300, 60
    period = [0.005 if t < onset else 0.035 for t in range(n)]
    t0 = np.cumsum([0.0] + period[:-1])
    late = [[0.03 if r == 2 and t >= onset else 0.0 for t in range(n)] for r in range(3)]
    starts = [[float(t0[t]) + late[r][t] for t in range(n)] for r in range(3)]
    gaps = [[0.001 + late[r][t] for t in range(n)] for r in range(3)]
    det, events = StragglerDetector(CFG), []
    for t in range(1, n + 1):
        ranks = [work(r, [0.004] * t, step_s=0.005, start=starts[r][:t], gap=gaps[r][:t]) for r in range(3)]
        events += [(t, ev) for ev in det.update(ranks, t) if ev.kind == "flagged"]
    assert [(ev.ranks, ev.score.cause) for _, ev in events] == [([2], "data")], events
    hold = math.ceil(CFG.hold_seconds / 0.035)
    assert events[0][0] <= onset + CFG.window + hold, events[0][0]


def test_new_workers_whose_steps_count_from_zero_are_scored_at_once_not_after_the_old_count():
    # A first job (or generation) of 400 steps with rank 0 slow; then new workers (a restart, or
    # the next job on a long-lived agent) count their steps from zero, with rank 2 slow.
    rng = random.Random(3)
    det = StragglerDetector(CFG)
    old = [[0.05 * 1.5] * 400 if r == 0 else noisy(rng, 400) for r in range(4)]
    assert 0 in first_flags(feed(det, old))
    new = [[0.05 * 1.5] * 120 if r == 2 else noisy(rng, 120) for r in range(4)]
    events = feed(det, new)
    flagged = first_flags(events)
    assert list(flagged) == [2] and flagged[2][0] <= 60, flagged   # not blind until step 400
    lifted = [t for t, ev in events if ev.kind == "cleared" and ev.score.rank == 0]
    assert lifted and lifted[0] <= 120   # the old flag is lifted by the new steps


def test_the_hold_counts_from_the_onset_and_a_threshold_beyond_the_clip_still_flags():
    # Rank 1 works 1.5x from step 60 on 0.1 s steps: the 1 s hold is 10 steps from the onset
    # (not from the confirmation, some steps later).  A threshold of 0.35 lies beyond the
    # per-step clip (log 1.35 > 0.3): the newest steps' clipped ratios still read as slow.
    onset, n = 60, 140
    for cfg in (CFG, StragglerConfig(warmup_steps=0, hold_seconds=1.0, threshold=0.35)):
        series = [[0.05] * n, [0.075 if t >= onset else 0.05 for t in range(n)], [0.05] * n]
        flags = first_flags(feed(StragglerDetector(cfg), series))
        assert list(flags) == [1], flags
        assert flags[1][0] <= onset + math.ceil(cfg.hold_seconds / 0.1) + 2, (cfg, flags[1][0])
