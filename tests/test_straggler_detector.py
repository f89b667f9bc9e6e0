"""The straggler detector as a pure function over per-step own work: no processes, no sleeping."""

import random

import pytest

from rankwatch.agent.straggler import RankWork, StragglerConfig, StragglerDetector, score

CFG = StragglerConfig(window=16, threshold=0.08, clear_threshold=0.03, confirm=10, clear_after=20,
                      warmup_steps=0)


def work(rank, own, data=None, step_s=0.1):
    return RankWork(rank=rank, node="n0", step=len(own), own=own, data=data or [0.001] * len(own),
                    wait=[0.0] * len(own), step_seconds=step_s, completed=len(own))


def run(detector, series, data=None, start=0):
    """Feed step by step; return {rank: first step flagged}."""
    flagged = {}
    n = len(series[0])
    for t in range(start + 1, n + 1):
        ranks = [work(r, s[:t], (data or {}).get(r, [0.001] * n)[:t]) for r, s in enumerate(series)]
        for ev in detector.update(ranks, t):
            if ev.kind == "flagged":
                flagged.setdefault(ev.score.rank, (t, ev.score))
    return flagged


def noisy(rng, n, base=0.05, jitter=0.05):
    # Multiplicative noise plus occasional contention bursts (time only ever added).
    return [base * (1 + rng.uniform(-jitter, jitter)) + (base * 0.5 if rng.random() < 0.05 else 0)
            for _ in range(n)]


def test_two_ranks_compared_leave_one_out():
    s = {x.rank: x for x in score([work(0, [0.1] * 16), work(1, [0.125] * 16)], CFG)}
    assert s[1].slowdown == pytest.approx(1.25) and s[0].slowdown == pytest.approx(0.8)
    assert s[1].cause == "compute" and s[1].speedup == pytest.approx(0.1 / (0.1 - 0.025))


def test_data_cause():
    own = [0.1] * 16
    s = {x.rank: x for x in score([work(0, own), work(1, [0.15] * 16, data=[0.051] * 16)], CFG)}
    assert s[1].cause == "data"


@pytest.mark.parametrize("slow,within", [(0.25, 25), (0.5, 25), (0.10, 50)])
def test_slowdown_flagged_quickly(slow, within):
    rng = random.Random(1)
    onset, n = 60, 160
    series = [noisy(rng, n) for _ in range(8)]
    series[3] = [x * (1 + slow) if t >= onset else x for t, x in enumerate(series[3])]
    flagged = run(StragglerDetector(CFG), series)
    assert set(flagged) == {3}
    step, sc = flagged[3]
    assert step - onset <= within and sc.slowdown == pytest.approx(1 + slow, rel=0.1)


def test_no_false_positive_on_100k_steps_of_noise():
    # 100,000 steps of 8 ranks with jitter and contention bursts.
    rng = random.Random(7)
    det = StragglerDetector(CFG)
    ranks_own = [[] for _ in range(8)]
    for t in range(1, 100_001):
        for r in range(8):
            ranks_own[r].append(noisy(rng, 1)[0])
            del ranks_own[r][:-16]
        ranks = [RankWork(rank=r, node="n0", step=t, own=list(o), data=[0.001] * len(o),
                          wait=[0.0] * len(o), step_seconds=0.1, completed=t) for r, o in enumerate(ranks_own)]
        assert not det.update(ranks, t), f"false positive at step {t}"


def test_hysteresis_no_flapping():
    rng = random.Random(3)
    n = 400
    series = [noisy(rng, n) for _ in range(4)]
    # Rank 2 hovers around the threshold after step 50: flagged at most once.
    series[2] = [x * (1.09 if (t // 5) % 2 else 1.06) if t >= 50 else x for t, x in enumerate(series[2])]
    det = StragglerDetector(CFG)
    events = []
    for t in range(1, n + 1):
        ranks = [work(r, s[:t]) for r, s in enumerate(series)]
        events += det.update(ranks, t)
    assert len([e for e in events if e.kind == "flagged"]) <= 1
    assert len([e for e in events if e.kind == "cleared"]) == 0


def test_cleared_after_recovery():
    n = 200
    series = [[0.05] * n for _ in range(3)]
    series[1] = [0.08 if 20 <= t < 100 else 0.05 for t in range(n)]
    det = StragglerDetector(CFG)
    kinds = []
    for t in range(1, n + 1):
        kinds += [e.kind for e in det.update([work(r, s[:t]) for r, s in enumerate(series)], t)]
    assert kinds == ["flagged", "cleared"]
