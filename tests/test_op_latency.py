"""A rank's per-op collective latency for status: counts, and quantiles over a recent window."""

from __future__ import annotations

import numpy as np
import pytest

from rankwatch.agent.node.oplatency import OpLatency, quantiles, to_pb

OPS = ("all_reduce", "all_gather", "reduce_scatter")


def test_quantiles_and_counts_by_op():
    lat = OpLatency(OPS, window=1000)
    ops = np.array([0] * 100 + [2] * 50)
    durations = np.concatenate([np.linspace(0.001, 0.1, 100), np.full(50, 0.003)])
    lat.observe(ops, durations)
    s = lat.summary()
    assert set(s) == {"all_reduce", "reduce_scatter"}
    assert s["all_reduce"].count == 100 and s["all_reduce"].window == 100
    assert s["all_reduce"].p50 == pytest.approx(0.0505, rel=1e-3)
    assert s["all_reduce"].p99 == pytest.approx(np.quantile(durations[:100], 0.99))
    assert s["reduce_scatter"].p50 == s["reduce_scatter"].p99 == pytest.approx(0.003)


def test_the_window_keeps_the_most_recent_calls():
    lat = OpLatency(OPS, window=8)
    lat.observe(np.zeros(5, np.int64), np.full(5, 1.0))       # old and slow
    for _ in range(3):
        lat.observe(np.zeros(4, np.int64), np.full(4, 0.01))  # recent and fast, across the ring's end
    s = lat.summary()["all_reduce"]
    assert s.count == 17 and s.window == 8 and s.p99 == pytest.approx(0.01)
    lat.observe(np.zeros(20, np.int64), np.arange(20, dtype=np.float64))  # one batch over the window
    s = lat.summary()["all_reduce"]
    assert s.count == 37 and s.p50 == pytest.approx(np.quantile(np.arange(12, 20), 0.5))


def test_wire_form():
    lat = OpLatency(OPS)
    lat.observe(np.array([1, 1]), np.array([0.002, 0.004]))
    (op, msg), = to_pb(lat).items()
    assert op == "all_gather" and msg.count == 2 and msg.window == 2
    assert msg.p50_seconds == pytest.approx(0.003)


@pytest.mark.parametrize("seed", range(20))
def test_quantiles_equal_numpys(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 600))
    x = rng.exponential(1e-3, n) if seed % 3 else rng.integers(0, 4, n).astype(np.float64)  # ties too
    qs = (0.5, 0.99, 0.0, 1.0, float(rng.random()))
    assert quantiles(x.copy(), qs) == [float(v) for v in np.quantile(x, qs)]


def test_a_batch_of_several_ops_keeps_each_ops_order():
    # The ring keeps the most recent calls of each op, in order, whatever ops interleave them.
    lat = OpLatency(OPS, window=4)
    ops = np.array([0, 2, 0, 1, 0, 2, 0, 0], np.uint8)
    lat.observe(ops, np.arange(8, dtype=np.float64))
    s = lat.summary()
    assert s["all_reduce"].count == 5 and s["all_reduce"].window == 4
    assert s["all_reduce"].p50 == np.quantile([2.0, 4.0, 6.0, 7.0], 0.5)   # the oldest call, 0, left
    assert s["all_gather"].p50 == 3.0 and s["reduce_scatter"].p99 == np.quantile([1.0, 5.0], 0.99)
    lat.observe(np.array([0], np.uint8), np.array([100.0]))
    assert lat.summary()["all_reduce"].p99 == np.quantile([4.0, 6.0, 7.0, 100.0], 0.99)


@pytest.mark.parametrize("seed", range(5))
def test_each_ops_window_is_its_most_recent_calls_in_a_big_mixed_batch(seed):
    # Against a reading call by call: each op's window holds its last calls, whatever the
    # batch's order (a sort that is not stable would keep others).
    rng = np.random.default_rng(seed)
    lat = OpLatency(OPS, window=16)
    ops = rng.integers(0, 3, 1000).astype(np.uint8)
    durations = rng.random(1000)
    lat.observe(ops, durations)
    s = lat.summary()
    for i, name in enumerate(OPS):
        recent = durations[ops == i][-16:]
        assert s[name].p50 == np.quantile(recent, 0.5) and s[name].p99 == np.quantile(recent, 0.99)
