"""Validation and aggregation in NodeState: pure, no server."""

import math

import numpy as np
import pytest

from rankwatch.agent.node.histogram import HistogramSet
from rankwatch.agent.node.intake import OPS, NodeState, Rejected
from rankwatch.proto import pb


def hello(rank=0, world=4, pid=1234, **kw):
    return pb.Hello(rank=rank, world_size=world, pid=pid, node_id="n0", backend="gloo",
                    op_names=list(OPS), **kw)


def coll_batch(seq, ops, durations, seqs=None):
    n = len(ops)
    c = pb.CollectiveColumns(
        op=np.asarray(ops, "<u1").tobytes(), pg=np.zeros(n, "<u2").tobytes(),
        seq=np.asarray(seqs if seqs is not None else range(n), "<i8").tobytes(),
        start=np.full(n, 1e9, "<f8").tobytes(), duration=np.asarray(durations, "<f8").tobytes(),
        nbytes=np.full(n, 64, "<i8").tobytes())
    return pb.Batch(seq=seq, collectives=c)


def test_ingest_counts_by_op():
    st = NodeState("n0")
    r = st.hello(hello())
    assert st.ingest(r, coll_batch(1, [0, 0, 1], [1e-3, 2e-3, 3e-3])) == 3
    assert r.collective_counts[0] == 2 and r.collective_counts[1] == 1
    assert st.coll_hist.count(0) == 2
    assert st.records["collective"] == 3


@pytest.mark.parametrize("durations", [[math.nan], [-1.0], [math.inf]])
def test_bad_durations_rejected_whole(durations):
    st = NodeState("n0")
    r = st.hello(hello())
    with pytest.raises(Rejected) as e:
        st.ingest(r, coll_batch(1, [0], durations))
    assert e.value.reason == "invalid_value"
    assert r.collective_counts.sum() == 0 and r.last_batch_seq == 0


def test_ragged_columns_rejected():
    st = NodeState("n0")
    r = st.hello(hello())
    b = coll_batch(1, [0, 1], [1e-3, 1e-3])
    b.collectives.seq = b"\x00" * 3
    with pytest.raises(Rejected, match="malformed"):
        st.ingest(r, b)


def test_op_code_outside_names_rejected():
    st = NodeState("n0")
    r = st.hello(hello())
    with pytest.raises(Rejected, match="op code"):
        st.ingest(r, coll_batch(1, [200], [1e-3]))


def test_duplicate_and_stale_batches_rejected():
    st = NodeState("n0")
    r = st.hello(hello())
    st.ingest(r, coll_batch(2, [0], [1e-3]))
    with pytest.raises(Rejected, match="duplicate_batch"):
        st.ingest(r, coll_batch(2, [0], [1e-3]))
    with pytest.raises(Rejected, match="duplicate_batch"):
        st.ingest(r, coll_batch(1, [0], [1e-3]))


@pytest.mark.parametrize("msg,reason", [
    (hello(rank=4, world=4), "unknown_rank"),
    (hello(rank=-1), "unknown_rank"),
    (hello(world=0), "invalid_hello"),
    (hello(pid=0), "invalid_hello"),
    (hello(peak_flops=math.nan), "invalid_hello"),
    (pb.Hello(rank=0, world_size=2, pid=5, node_id="x" * 1000), "invalid_hello"),
    (pb.Hello(rank=0, world_size=2, pid=5, backend="a\nb"), "invalid_hello"),
])
def test_bad_hello(msg, reason):
    with pytest.raises(Rejected) as e:
        NodeState("n0").hello(msg)
    assert e.value.reason == reason


def test_duplicate_live_rank_refused_dead_one_replaced():
    st = NodeState("n0")
    st.hello(hello(pid=111))
    with pytest.raises(Rejected, match="duplicate_rank"):
        st.hello(hello(pid=222), alive=lambda pid: True)
    new = st.hello(hello(pid=333), alive=lambda pid: False)  # old process is gone: a restart
    assert st.ranks[0] is new


def test_steps_and_phases():
    st = NodeState("n0")
    r = st.hello(hello())
    s = pb.StepColumns(step=[1, 2], start=[1.0, 2.0], duration=[0.5, 0.7], data=[0.1, 0.1],
                       forward=[0.1, 0.2], backward=[0.2, 0.3], optimizer=[0.05, 0.05],
                       tokens=[100, 100], flops=[1e9, 1e9])
    st.ingest(r, pb.Batch(seq=1, steps=s))
    assert r.step == 2 and r.step_seconds == pytest.approx(0.6)
    # Phases are medians over the same steps as the step time (0.5 and 0.7 s here).
    assert r.phase_seconds == pytest.approx({"data": 0.1, "forward": 0.15, "backward": 0.25,
                                             "optimizer": 0.05, "other": 0.05})
    assert r.tokens_per_second == pytest.approx(200 / 1.2)
    bad = pb.StepColumns(step=[3], start=[1.0], duration=[-0.5], data=[0], forward=[0],
                         backward=[0], optimizer=[0], tokens=[0], flops=[0])
    with pytest.raises(Rejected):
        st.ingest(r, pb.Batch(seq=2, steps=bad))


def test_rejections_counted():
    st = NodeState("n0")
    st.note_rejected(Rejected("malformed", "x"))
    st.note_rejected(Rejected("malformed", "y"))
    assert st.rejected == {"malformed": 2}


def test_histogram_matches_numpy():
    h = HistogramSet(2, (0.1, 1.0))
    vals = np.array([0.05, 0.1, 0.5, 2.0, 0.01])
    series = np.array([0, 0, 1, 1, 0])
    h.observe_many(series, vals)
    assert h.cumulative(0) == [("0.1", 3), ("1.0", 3), ("+Inf", 3)]
    assert h.cumulative(1) == [("0.1", 0), ("1.0", 1), ("+Inf", 2)]
    assert h.sums[1] == pytest.approx(2.5)


def test_mfu_only_when_every_rank_knows_its_peak():
    st = NodeState("n0")
    s = pb.StepColumns(step=[1], start=[1.0], duration=[0.5], data=[0], forward=[0], backward=[0],
                       optimizer=[0], tokens=[100], flops=[5e11])
    r0 = st.hello(hello(rank=0, peak_flops=2e12))
    st.ingest(r0, pb.Batch(seq=1, steps=s))
    assert st.mfu() == pytest.approx(5e11 / 0.5 / 2e12)
    r1 = st.hello(hello(rank=1, pid=99))  # no peak: CPU without --peak-tflops
    st.ingest(r1, pb.Batch(seq=1, steps=s))
    assert st.mfu() is None


def test_flight_recorder_extract_kept_with_the_stacks_and_checked():
    import json
    st = NodeState("n0")
    r = st.hello(hello())
    fr = {"pending": [{"group": "0", "desc": "default_pg", "seq": 9, "op": "all_reduce",
                       "state": "scheduled", "since": 1.5e9}], "completed": {"0": 8, "1": 3},
          "enqueued": {"0": 9, "1": 3}}
    st.ingest(r, pb.Batch(seq=1, progress=pb.Progress(step=4, stacks="Thread main",
                                                      flight_recorder=json.dumps(fr))))
    assert r.flight_recorder == fr and r.stacks == "Thread main"
    bad = [
        "{not json",
        json.dumps([1, 2]),
        json.dumps({"pending": {"seq": 1}}),
        json.dumps({"pending": [{"group": "0", "seq": "x", "op": "a", "since": 0}]}),
        json.dumps({"pending": [{"group": "0", "seq": 1, "op": "a\nb", "since": 0}]}),
        json.dumps({"pending": [], "completed": {"0": 1.5}}),
        json.dumps({"pending": [], "enqueued": [1]}),
        '{"pending": [{"group": "0", "seq": 1, "op": "a", "since": NaN}]}',
    ]
    for seq, text in enumerate(bad, start=2):
        with pytest.raises(Rejected) as e:
            st.ingest(r, pb.Batch(seq=seq, progress=pb.Progress(step=5, flight_recorder=text)))
        assert e.value.reason == "malformed", text
    with pytest.raises(Rejected, match="oversized"):
        st.ingest(r, pb.Batch(seq=20, progress=pb.Progress(step=5, flight_recorder="x" * (1 << 20))))
    assert r.flight_recorder == fr, "a refused extract leaves the last good one"
