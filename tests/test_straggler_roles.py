"""Stragglers are compared within a role (the pipeline stage): stages that differ by design are
no straggler, a slow rank of a stage is measured against its own stage's ranks."""

from __future__ import annotations

from rankwatch.agent.detect.work_scores import RankWork, StragglerConfig, role_of, score


def _ranks(slow: int | None = None, roles: bool = True) -> list[RankWork]:
    """Two stages of two ranks; stage 1 (the head-heavy one) works 3x stage 0's."""
    out = []
    for r in range(4):
        base = (0.01 if r < 2 else 0.03) * (1.5 if r == slow else 1.0)
        out.append(RankWork(rank=r, node="n0", step=64, own=[base] * 64, data=[0.0] * 64, wait=[0.001] * 64,
                            step_seconds=0.04, completed=64, role=(r // 2) if roles else 0))
    return out


def test_stages_that_differ_by_design_are_no_stragglers():
    assert [round(s.slowdown, 2) for s in score(_ranks(), StragglerConfig())] == [1.0] * 4
    # without roles, the heavy stage's ranks stood out (the false straggler)
    assert max(s.slowdown for s in score(_ranks(roles=False), StragglerConfig())) > 2


def test_a_slow_rank_is_measured_against_its_own_stage():
    by_rank = {s.rank: s.slowdown for s in score(_ranks(slow=0), StragglerConfig())}
    assert round(by_rank[0], 2) == 1.5 and by_rank[2] == by_rank[3] == 1.0


def test_a_role_is_the_pipeline_stage():
    assert role_of({"pp": 1, "dp": 0}) == 1 and role_of({"dp": 1}) == 0 and role_of(None) == 0
