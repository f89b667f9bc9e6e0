"""A straggler whose experts received more tokens is ``expert_load``, not ``compute``: the
cause rule (agent/detect/work_scores.py) and the records that carry the load to it (a real
NodeState ingesting a rank's batches, and the summary the coordinator reads)."""

from __future__ import annotations

import math

import pytest

from rankwatch.agent.detect.straggler import StragglerDetector
from rankwatch.agent.detect.work_scores import RankWork, StragglerConfig, score
from rankwatch.agent.detect.checkpoint_due import wants_eviction
from rankwatch.agent.node.intake import OPS, NodeState, Rejected
from rankwatch.agent.views.answer import node_summary
from rankwatch.agent.wire import summary as check_sync
from rankwatch.proto import pb


def _ranks(slow: int, tokens: list[float]) -> list[RankWork]:
    """Four ranks of one role; ``slow`` works 1.6x the others; ``tokens`` per step each."""
    return [RankWork(rank=r, node="n0", step=64, own=[0.01 * (1.6 if r == slow else 1.0)] * 64, data=[0.0] * 64,
                     wait=[0.001] * 64, step_seconds=0.02, completed=64, tokens=tokens[r]) for r in range(4)]


def _cause(ranks: list[RankWork], rank: int) -> str:
    return next(s.cause for s in score(ranks, StragglerConfig()) if s.rank == rank)


def test_a_slow_rank_whose_experts_got_more_tokens_is_expert_load():
    assert _cause(_ranks(2, [100, 100, 190, 100]), 2) == "expert_load"


def test_a_slow_rank_with_the_same_load_is_compute_and_a_small_excess_of_tokens_explains_nothing():
    assert _cause(_ranks(2, [100, 100, 100, 100]), 2) == "compute"
    assert _cause(_ranks(2, [100, 100, 110, 100]), 2) == "compute"   # 10 % more tokens, 60 % more work
    assert _cause(_ranks(2, [math.nan] * 4), 2) == "compute"         # no MoE: nothing said


def test_experts_that_got_no_tokens_are_a_load_of_zero_not_no_load():
    # A hot expert on rank 1 takes every token: rank 0's experts get none, a load all the same.
    assert _cause(_ranks(1, [0, 400, 0, 0]), 1) == "expert_load"


def _hello(rank: int) -> pb.Hello:
    return pb.Hello(rank=rank, world_size=4, pid=1000 + rank, node_id="n0", backend="gloo", op_names=list(OPS))


def test_a_ranks_expert_loads_reach_its_summary_as_tokens_per_step():
    st = NodeState("n0")
    r = st.hello(_hello(0))
    loads = [pb.ExpertLoad(step=s, tokens=[30, 10 * s]) for s in range(1, 5)]
    st.ingest(r, pb.Batch(seq=1, expert_loads=loads))
    assert r.expert_tokens_per_step == pytest.approx((40 + 50 + 60 + 70) / 4)
    s = node_summary(st, 1, decisions=[], run_id="", relay_address=None, step_period=lambda _r, sec: sec)
    [rs] = s.ranks
    assert rs.expert_tokens == pytest.approx(55.0)
    check_sync.check_summary(s)   # in range for the coordinator
    idle = st.hello(_hello(1))
    st.ingest(idle, pb.Batch(seq=1, expert_loads=[pb.ExpertLoad(step=1, tokens=[0, 0])]))
    quiet = st.hello(_hello(2))
    by_rank = {r.rank: r for r in node_summary(st, 2, decisions=[], run_id="", relay_address=None,
                                               step_period=lambda _r, sec: sec).ranks}
    assert by_rank[1].HasField("expert_tokens") and by_rank[1].expert_tokens == 0.0
    assert not by_rank[2].HasField("expert_tokens") and math.isnan(quiet.expert_tokens_per_step)


@pytest.mark.parametrize("load", [pb.ExpertLoad(step=1, tokens=[1] * 257), pb.ExpertLoad(step=1, tokens=[1 << 53]),
                                  pb.ExpertLoad(step=-2, tokens=[1])])
def test_an_expert_load_out_of_range_refuses_the_batch_whole(load):
    st = NodeState("n0")
    r = st.hello(_hello(0))
    with pytest.raises(Rejected):
        st.ingest(r, pb.Batch(seq=1, expert_loads=[load]))
    assert not r.expert_tokens and r.last_batch_seq == 0


def test_a_token_excess_that_explains_the_slowdown_outranks_a_run_delay():
    # A shared host's run delay covers the hot rank's excess too; its tokens explain it exactly.
    ranks = _ranks(2, [100, 100, 190, 100])
    for r in ranks:
        r.delay = [0.006 if r.rank == 2 else 0.0] * 64
    assert _cause(ranks, 2) == "expert_load"
    for r in ranks:
        r.tokens = 100.0
    assert _cause(ranks, 2) == "host"


def _flags(slow_by: float, tokens: list[float], steps: int = 200) -> dict[int, str]:
    """Feed the detector ``steps`` steps of four ranks, rank 2 ``slow_by`` slower; its flags."""
    det = StragglerDetector(StragglerConfig(warmup_steps=0, hold_seconds=0.5))
    own: dict[int, list[float]] = {r: [] for r in range(4)}
    for step in range(1, steps + 1):
        for r in range(4):
            own[r].append(0.01 * (slow_by if r == 2 else 1.0) * (1 + 0.02 * ((step * (r + 3)) % 5 - 2)))
        det.update([RankWork(rank=r, node="n0", step=step, own=own[r][-64:], data=[0.0] * min(step, 64),
                             wait=[0.001] * min(step, 64), step_seconds=0.02, completed=step, tokens=tokens[r])
                    for r in range(4)], step)
    return {rank: s.cause for rank, s in det.flagged.items()}


def test_a_hot_expert_is_flagged_and_the_routings_own_mild_skew_is_not():
    # Experts are uneven by nature: 1.3x the tokens and 1.3x the work is no straggler ...
    assert _flags(1.3, [100, 100, 130, 100]) == {}
    # ... a hot expert is (2x the tokens, 2x the work) ...
    assert _flags(2.0, [100, 100, 200, 100]) == {2: "expert_load"}
    # ... and so is a rank as slow with the same tokens (its own compute).
    assert _flags(1.3, [100, 100, 100, 100]) == {2: "compute"}


def test_an_expert_load_straggler_is_never_evicted():
    # Without its node the router sends its hot experts' tokens to another: eviction cannot help.
    assert wants_eviction(3.0, 1.25, "compute") and not wants_eviction(3.0, 1.25, "expert_load")
