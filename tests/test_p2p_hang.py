"""A pipeline hang is named with both ends: who waits in a send or receive on whom, in which
microbatch (agent/detect/p2p_wait.py through the hang verdict); injected time, no sleeping.
The e2e test (test_e2e_pipeline_hang.py) stops a real stage."""

from rankwatch.agent.detect import p2p_wait
from rankwatch.agent.detect.hang_verdict import HangConfig, RankProgress, detect_hang

CFG = HangConfig(floor_seconds=5.0, step_multiple=5.0, first_step_seconds=60.0,
                 checkpoint_seconds=300.0, silence_seconds=2.0)


def rank(r, stage, *, progress_at=0.0, last_seen=10.0, seqs=None, inflight=None):
    return RankProgress(rank=r, node=f"n{r}", step=20, step_seconds=0.1, steps_completed=20, activity="train",
                        progress_at=progress_at, last_seen=last_seen, connected=True, group_seqs=seqs or {},
                        inflight=inflight, role=stage)


def p2p(op, peer, seq=7, microbatch=None, microbatch_pass="backward"):
    out = {"op": op, "group": "0", "seq": seq, "since": 0.0, "peer": peer}
    if microbatch is not None:
        out.update(microbatch=microbatch, microbatch_pass=microbatch_pass)
    return out


def test_a_stopped_stage_is_named_with_the_stage_that_waits_on_it_and_the_microbatch():
    # pp=2 x dp=2: ranks 0, 1 are stage 0; 2, 3 stage 1.  Rank 3 is SIGSTOPped (silent).
    v = detect_hang(10.0, [rank(0, 0, inflight=p2p("recv", 2, microbatch=1)),
                           rank(1, 0, inflight=p2p("recv", 3, microbatch=3)),
                           rank(2, 1, inflight={"op": "all_reduce", "group": "dp", "seq": 9, "since": 0.0}),
                           rank(3, 1, last_seen=1.0)], CFG)
    assert v.culprit.rank == 3
    assert v.p2p == {"waiter": 1, "waiter_stage": 0, "op": "recv", "microbatch": 3, "microbatch_pass": "backward",
                     "peer": 3, "peer_stage": 1, "peer_op": None, "peer_microbatch": None,
                     "peer_microbatch_pass": None}
    assert "rank 1 (stage 0) waits in recv from rank 3 (stage 1) (its backward microbatch 3)" in v.reason


def test_two_stages_waiting_for_each_other_are_a_deadlock_named_both_ways():
    v = detect_hang(10.0, [rank(0, 0, progress_at=1.0, inflight=p2p("recv", 1, microbatch=2, microbatch_pass="forward")),
                           rank(1, 1, progress_at=0.5, seqs={"0": 5}, inflight=p2p("recv", 0, seq=6))], CFG)
    assert v.culprit.rank == 1   # the longer stalled
    assert v.reason.startswith("a point-to-point deadlock: ")
    assert "rank 0 (stage 0) waits in recv from rank 1 (stage 1) (its forward microbatch 2), which waits in recv" \
        in v.reason
    assert "rank 1 (stage 1) waits in recv from rank 0 (stage 0)" in v.reason
    assert v.p2p["waiter"] == 0 and v.p2p["peer"] == 1


def test_a_stage_that_never_posts_the_matching_receive_is_named_not_the_one_behind_on_sequence():
    # Rank 1 is heard and computing (inside no operation); rank 0 waits in its send.  On the
    # group's sequence numbers rank 0 is the one behind (it posted fewer operations), which
    # would name the wrong end without the P2P edge.
    v = detect_hang(10.0, [rank(0, 0, seqs={"0": 4}, inflight=p2p("send", 1, seq=5)),
                           rank(1, 1, seqs={"0": 9})], CFG)
    assert v.culprit.rank == 1
    assert v.reason.startswith("it never posted the point-to-point operation a peer waits in")
    assert "rank 0 (stage 0) waits in send to rank 1 (stage 1)" in v.reason


def test_a_receive_from_any_source_or_a_collective_is_no_edge():
    ranks = [rank(0, 0, inflight=p2p("recv", -1)), rank(1, 1, inflight={"op": "all_reduce", "group": "0",
                                                                          "seq": 3, "since": 0.0, "peer": 0})]
    assert p2p_wait.waits_on(ranks) == {}
    assert p2p_wait.deadlock(ranks) is None


def test_a_long_chain_ends_at_its_cycle_and_is_walked_once_per_rank():
    # 0 -> 1 -> 2 -> 3 -> 2: the cycle is {2, 3}, listed lowest rank first.
    ranks = [rank(0, 0, inflight=p2p("recv", 1)), rank(1, 1, inflight=p2p("recv", 2)),
             rank(2, 2, inflight=p2p("recv", 3)), rank(3, 3, inflight=p2p("send", 2))]
    assert [r.rank for r in p2p_wait.deadlock(ranks)] == [2, 3]
