"""The collective columns' checks, in their fast whole-column form, refuse exactly what a
value-by-value reading of the ranges refuses (report.check_collective_columns)."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from rankwatch.agent.wire import ranges, report
from rankwatch.agent.node.oplatency import OpLatency

NOW = 1.7e9
DAY = 86400.0
EDGE_INTS = [0, 1, -1, -2, 2**53 - 1, 2**53, 2**53 + 1, 2**62, 2**63 - 1, -(2**63)]
EDGE_FLOATS = [0.0, -0.0, 1e-9, -1e-300, DAY, math.nextafter(DAY, math.inf), NOW, NOW + DAY,
               math.nextafter(NOW + DAY, math.inf), math.inf, -math.inf, math.nan, 1e300, -5.0]


def ints() -> st.SearchStrategy[int]:
    return st.one_of(st.sampled_from(EDGE_INTS), st.integers(-(2**63), 2**63 - 1), st.integers(-3, 2**20))


def floats() -> st.SearchStrategy[float]:
    return st.one_of(st.sampled_from(EDGE_FLOATS), st.floats(allow_nan=True, allow_infinity=True),
                     st.floats(0, 2 * DAY))


def in_range(seq: list[int], start: list[float], duration: list[float], nbytes: list[int]) -> bool:
    return (all(-1 <= s < 2**53 for s in seq) and all(0 <= b < 2**53 for b in nbytes)
            and all(math.isfinite(d) and 0 <= d <= DAY for d in duration)
            and all(math.isfinite(t) and 0 <= t <= NOW + DAY for t in start))


@settings(max_examples=600, deadline=None)
@given(st.integers(1, 12).flatmap(lambda n: st.tuples(
    st.lists(ints(), min_size=n, max_size=n), st.lists(floats(), min_size=n, max_size=n),
    st.lists(floats(), min_size=n, max_size=n), st.lists(ints(), min_size=n, max_size=n))))
def test_fast_checks_refuse_exactly_the_values_out_of_range(columns):
    seq, start, duration, nbytes = columns
    cols = {"seq": np.array(seq, "<i8"), "start": np.array(start, "<f8"),
            "duration": np.array(duration, "<f8"), "nbytes": np.array(nbytes, "<i8")}
    try:
        report.check_collective_columns(cols, NOW)
        refused = False
    except ranges.Rejected as exc:
        assert exc.reason == "invalid_value"
        refused = True
    assert refused != in_range(seq, start, duration, nbytes)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 40), st.lists(st.lists(st.integers(0, 4), max_size=90), min_size=1, max_size=10))
def test_op_latency_keeps_each_ops_count_and_newest_calls(window, batches):
    lat = OpLatency(("a", "b", "c", "d", "e"), window=window)
    seen: dict[int, list[float]] = {}
    t = 0.0
    for batch in batches:
        ops = np.array(batch, np.int64)
        durations = t + np.arange(len(batch), dtype=np.float64)
        t += len(batch)
        lat.observe(ops, durations)
        for op, d in zip(batch, durations):
            seen.setdefault(op, []).append(float(d))
    s = lat.summary()
    assert set(s) == {lat.ops[op] for op in seen}
    no_batch_over_window = all(batch.count(op) <= window for batch in batches for op in seen)
    for op, values in seen.items():
        got = s[lat.ops[op]]
        assert got.count == len(values) and got.window == min(len(values), window)
        if no_batch_over_window:   # the ring holds exactly the op's newest `window` calls
            assert sorted(lat._ring[op][:got.window].tolist()) == values[-window:]
