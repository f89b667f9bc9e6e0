"""``Monitor.steps``: each step's scope opens before its batch is fetched (a real Recorder, no agent)."""

from __future__ import annotations

import time

from rankwatch.hooks.instrument.monitor import Monitor, NullMonitor
from rankwatch.hooks.instrument.recorder import Recorder

FETCH, WORK = 0.03, 0.01


def _slow_loader(n: int):
    for i in range(n):
        time.sleep(FETCH)
        yield i


def test_the_fetch_is_the_steps_data_phase():
    rec = Recorder()
    mon = Monitor(rec, None, None)
    seen = []
    for n, batch in mon.steps(_slow_loader(3), start=5, tokens=64.0):
        seen.append((n, batch))
        time.sleep(WORK)
        mon.mark("forward")
    assert seen == [(5, 0), (6, 1), (7, 2)]
    assert [s[0] for s in rec.steps] == [5, 6, 7] and rec.step == 7  # no step 8: the loader ended
    for step, t0, t1, data, forward, *_rest in rec.steps:
        assert data >= FETCH * 1e9 and forward >= WORK * 1e9
        assert t1 - t0 >= data + forward  # the fetch is inside the step
    assert all(s[7] == 64.0 for s in rec.steps)


def test_a_break_ends_the_step():
    rec = Recorder()
    mon = Monitor(rec, None, None)
    for n, _ in mon.steps(range(10)):
        if n == 2:
            break
    assert [s[0] for s in rec.steps] == [1, 2]


def test_the_null_monitor_numbers_batches_the_same_way():
    assert list(NullMonitor().steps("ab", start=3)) == [(3, "a"), (4, "b")]
