"""Imbalance by design: the pipeline stages' balance and the experts' skew (the rule in
agent/detect/imbalance.py), read from a node's real intake and from the coordinator's view of
the nodes' summaries, shown in ``status`` and ``/metrics``."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from rankwatch.agent.detect.imbalance import BalanceConfig, Stage, experts, pipeline
from rankwatch.agent.durable.incidents import IncidentLog
from rankwatch.agent.export.prom_pipeline import BalanceCollector
from rankwatch.agent.job.coordinator import Coordinator
from rankwatch.agent.durable.decisions import DecisionLog
from rankwatch.agent.job.goodput import StepProgress
from rankwatch.agent.link.known import JobKnowledge
from rankwatch.agent.node.intake import OPS, NodeState
from rankwatch.agent.views.answer import node_summary, status_response
from rankwatch.agent.views.work_spread import BalanceWatch
from rankwatch.proto import pb
from rankwatch.status import status_dict

CFG = BalanceConfig()


def windows(own: float, wait: float, n: int = 32) -> tuple[list[float], list[float]]:
    return [own] * n, [wait] * n


def test_a_head_heavy_stage_is_named_with_its_ratio_and_the_bubbles():
    # Stage 1 works 0.019 s a step, stage 0 0.010 s and waits 0.009 s for it: both steps 0.019 s.
    p = pipeline([(0, *windows(0.010, 0.009)), (0, *windows(0.0102, 0.0088)), (1, *windows(0.019, 0.0))], CFG)
    assert [s.stage for s in p.stages] == [0, 1] and [s.ranks for s in p.stages] == [2, 1]
    assert (p.heaviest, p.lightest) == (1, 0)
    assert p.imbalance == pytest.approx(0.019 / 0.0101)
    assert p.stages[0].bubble == pytest.approx(1 - 0.0101 / 0.019) and p.stages[1].bubble == 0.0
    assert p.idle == pytest.approx((1 - 0.0101 / 0.019) / 2)
    assert p.text() == "stage 1 works 1.9x stage 0: the pipeline idles 23% of the step"


def test_no_finding_without_two_stages_with_enough_steps():
    assert pipeline([(0, *windows(0.01, 0.0)), (0, *windows(0.01, 0.0))], CFG) is None
    short = windows(0.01, 0.0, n=CFG.min_steps - 1)
    assert pipeline([(0, *windows(0.01, 0.0)), (1, *short)], CFG) is None
    assert pipeline([(0, *windows(0.01, 0.0)), (1, *windows(0.02, 0.0, n=CFG.min_steps))], CFG) is not None


def test_medians_ignore_a_few_slow_steps_and_only_the_last_window_counts():
    own, wait = windows(0.01, 0.01, n=100)
    own[-3:] = [1.0] * 3          # a checkpoint step or two
    own[:50] = [5.0] * 50         # long ago, outside the window
    p = pipeline([(0, own, wait), (1, *windows(0.02, 0.0))], CFG)
    assert p.stages[0].compute == pytest.approx(0.01)


def test_a_bubble_stays_in_range():
    assert Stage(stage=0, ranks=1, compute=0.02, step=0.01).bubble == 0.0
    assert Stage(stage=0, ranks=1, compute=0.0, step=0.0).bubble == 0.0
    assert Stage(stage=0, ranks=1, compute=0.0, step=0.01).bubble == 1.0


def test_expert_skew_is_the_hottest_ranks_tokens_over_the_mean():
    e = experts({0: 100.0, 1: 300.0, 2: math.nan})
    assert (e.hottest, e.skew) == (1, pytest.approx(1.5)) and set(e.tokens) == {0, 1}
    assert experts({0: 100.0, 1: 100.0}).skew == 1.0
    assert experts({0: 0.0, 1: 400.0}).skew == 2.0   # experts with no token are a load of zero
    assert experts({0: 100.0}) is None and experts({0: 0.0, 1: 0.0}) is None and experts({}) is None


def test_the_config_is_checked():
    with pytest.raises(ValueError):
        BalanceConfig(window=4, min_steps=8)
    with pytest.raises(ValueError):
        BalanceConfig(min_steps=0)


def _node(name: str, ranks: dict[int, tuple[int, float, float, list[int] | None]]) -> NodeState:
    """A node whose ranks (rank: stage, own, wait, expert tokens) reported 32 steps through the
    intake, as real batches do."""
    st = NodeState(name)
    for rank, (stage, own, wait, tokens) in ranks.items():
        r = st.hello(pb.Hello(rank=rank, world_size=4, pid=1000 + rank, node_id=name, backend="gloo",
                              op_names=list(OPS), mesh_coords={"pp": stage, "dp": 0},
                              mesh_shape={"pp": 2, "dp": 1}))
        n = 32
        cols = pb.StepColumns(step=list(range(1, n + 1)), start=[1e9 + k for k in range(n)],
                              duration=[own + wait] * n, data=[0.0] * n, forward=[0.0] * n, backward=[0.0] * n,
                              optimizer=[0.0] * n, tokens=[0.0] * n, flops=[0.0] * n, wait=[wait] * n)
        loads = [pb.ExpertLoad(step=s, tokens=tokens) for s in range(1, n + 1)] if tokens else []
        st.ingest(r, pb.Batch(seq=1, steps=cols, expert_loads=loads))
    return st


def _lone(st: NodeState) -> JobKnowledge:
    """What a lone node agent knows of a job: it coordinates nothing."""
    return JobKnowledge(st, DecisionLog(), Coordinator(st.node_id, incidents=IncidentLog(None)),
                        coordinates=lambda: False, coordinator_node=lambda: "", progress=StepProgress(),
                        relay=lambda: None)


def _scrape(watch: BalanceWatch) -> str:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(BalanceCollector("n0", watch.findings))
    return generate_latest(reg).decode()


def test_a_node_reads_its_ranks_and_shows_them_in_status_and_metrics():
    st = _node("n0", {0: (0, 0.010, 0.009, [10, 30]), 1: (1, 0.019, 0.0, [60, 100])})
    watch = BalanceWatch()
    watch.update(st, None)
    pipe, skew = watch.shown()
    assert pipe.scope == "node" and pipe.imbalance == pytest.approx(1.9) and pipe.heaviest_stage == 1
    assert skew.hottest_rank == 1 and skew.skew == pytest.approx(160 / 100)
    shown = status_dict(status_response(st, _lone(st), {}, metrics_port=None, max_ranks=64,
                                        balance=watch.shown()))
    assert shown["pipeline"]["text"].startswith("stage 1 works 1.9x stage 0")
    assert [s["stage"] for s in shown["pipeline"]["stages"]] == [0, 1]
    assert shown["experts"]["tokens_per_step"] == {"0": 40.0, "1": 160.0}
    text = _scrape(watch)
    assert 'rankwatch_pipeline_stage_imbalance_ratio{node="n0",scope="node"} 1.9' in text
    assert 'rankwatch_pipeline_stage_bubble_ratio{node="n0",scope="node",stage="1"} 0.0' in text
    assert 'rankwatch_expert_load_skew_ratio{node="n0",scope="node"} 1.6' in text


def test_without_stages_or_experts_status_and_metrics_say_nothing():
    st = NodeState("n0")
    watch = BalanceWatch()
    watch.update(st, None)
    assert watch.shown() == (None, None)
    shown = status_dict(status_response(st, _lone(st), {}, metrics_port=None, max_ranks=64, balance=watch.shown()))
    assert shown["pipeline"] is None and shown["experts"] is None
    assert "rankwatch_pipeline_stage_imbalance_ratio{" not in _scrape(watch)


def test_the_coordinator_reads_stages_spread_over_nodes_from_their_summaries():
    # One stage per node: neither node alone has two stages; the job does.
    c = Coordinator("n0", incidents=IncidentLog(None))
    nodes = [_node("n0", {0: (0, 0.010, 0.015, [50])}), _node("n1", {1: (1, 0.025, 0.0, [150])})]
    for seq, st in enumerate(nodes, 1):
        c.sync(node_summary(st, seq, decisions=[], run_id="r", relay_address=None, step_period=lambda _r, s: s))
    watch = BalanceWatch()
    watch.update(nodes[0], c.view)
    pipe, skew = watch.shown()
    assert pipe.scope == "job" and pipe.imbalance == pytest.approx(2.5) and pipe.idle == pytest.approx(0.3)
    assert skew.scope == "job" and skew.hottest_rank == 1 and skew.skew == pytest.approx(1.5)
    scopes = [scope for scope, _p, _e in watch.findings()]
    assert scopes == ["node", "job"]
    assert c.exclude("n1", "test") is not None
    watch.update(nodes[0], c.view)
    assert watch.shown() == (None, None)   # an excluded node's stage is no part of the job


def test_a_status_answer_lists_a_bounded_number_of_stages():
    from rankwatch.agent.views.work_spread import pipeline_pb

    p = pipeline([(stage, *windows(0.01 * (1 + stage % 3), 0.0)) for stage in range(3000)], CFG)
    shown = pipeline_pb(p, "job")
    assert len(p.stages) == 3000 and len(shown.stages) == 1024
    assert shown.imbalance == pytest.approx(3.0)   # decided over every stage
