"""Training-thread cost per recorded event (microbenchmark).

    python benchmarks/hotpath.py

Medians over repeats of timeit loops, in ns per event:
- the floor: a perf_counter_ns plus a bounded-deque append;
- Recorder.collective (what every timer ends in), Recorder.mark, a whole step scope;
- the collective timer alone, around a no-op verb;
- a wrapped vs bare gloo all_reduce on a 1-rank group, in short
  interleaved pairs (median of the paired differences).
"""

from __future__ import annotations

import os
import statistics
import time
import timeit
from collections import deque

from rankwatch.hooks.instrument.recorder import Recorder

N = 200_000
REPEATS = 9


def per_event(stmt, setup_globals, n=N) -> float:
    times = timeit.repeat(stmt, globals=setup_globals, number=n, repeat=REPEATS)
    return statistics.median(times) / n * 1e9


def main() -> None:
    rec = Recorder(capacity=1 << 16)
    dq = deque(maxlen=1 << 16)
    clock = time.perf_counter_ns
    g = {"rec": rec, "dq": dq, "clock": clock}
    rows = [
        ("floor: perf_counter_ns + deque.append", per_event("dq.append((clock(), 1))", g)),
        ("Recorder.collective (timestamps given)", per_event("rec.collective(0, 0, 1, 5, 9, 64)", g)),
        ("Recorder.collective + 2 clock reads", per_event("t=clock(); rec.collective(0, 0, 1, t, clock(), 64)", g)),
        ("Recorder.mark", per_event("rec.mark('forward')", g)),
        ("step scope with 4 marks", per_event(
            "with rec.step_scope(1, 1.0, 1.0):\n rec.mark('data'); rec.mark('forward'); "
            "rec.mark('backward'); rec.mark('optimizer')", g, n=N // 4)),
    ]
    rows += gloo_rows()
    for name, ns in rows:
        print(f"| {name} | {ns:,.0f} ns |")


def gloo_rows() -> list[tuple[str, float]]:
    import torch
    import torch.distributed as dist

    from rankwatch.hooks.instrument.op_record import _PAYLOAD, _payload_reader, _peer_reader
    from rankwatch.hooks.instrument.collectives import CollectiveInstrumentation

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29611")
    dist.init_process_group("gloo", rank=0, world_size=1)
    t = torch.ones(1)
    # A small buffer: in a run the sender drains it every 100 ms; undrained,
    # 100k tuples would make the cyclic GC's full passes part of the figure.
    rec = Recorder(capacity=4096)
    instr = CollectiveInstrumentation(rec)
    bare = dist.all_reduce
    timed = instr._dist_wrapper(bare, 0, dist.distributed_c10d, _payload_reader(bare, _PAYLOAD["all_reduce"]),
                                _peer_reader(bare, "all_reduce"))
    noop = lambda tensor, op=None, group=None, async_op=False: None  # noqa: E731
    wrapped_noop = instr._dist_wrapper(noop, 0, dist.distributed_c10d, _payload_reader(noop, _PAYLOAD["all_reduce"]),
                                       _peer_reader(noop, "all_reduce"))
    instr._wrap_work_wait(dist.Work)  # the async path's completion timer
    g = {"bare": bare, "timed": timed, "t": t, "noop": noop, "wrapped_noop": wrapped_noop}
    stmts = {
        "noop": "noop(t)", "wrapped_noop": "wrapped_noop(t)",
        "sync_bare": "bare(t)", "sync_timed": "timed(t)",
        "async_bare": "bare(t, async_op=True).wait()", "async_timed": "timed(t, async_op=True).wait()",
    }
    # gloo's per-call time drifts by several us over seconds, so the variants
    # run in short interleaved rounds and we take the median paired difference.
    res: dict[str, list[float]] = {k: [] for k in stmts}
    for _ in range(31):
        for k, stmt in stmts.items():
            res[k].append(_once(stmt, g))
    instr.uninstall()
    dist.destroy_process_group()
    med = statistics.median

    def added(on: str, off: str) -> float:
        return med(a - b for a, b in zip(res[on], res[off]))

    return [
        ("collective timer alone (wrapper around a no-op verb)", added("wrapped_noop", "noop")),
        ("gloo all_reduce, 1 rank, sync: bare", med(res["sync_bare"])),
        ("gloo all_reduce, 1 rank, sync: added by the timer", added("sync_timed", "sync_bare")),
        ("gloo all_reduce, 1 rank, async+wait: bare", med(res["async_bare"])),
        ("gloo all_reduce, 1 rank, async+wait: added by the timer", added("async_timed", "async_bare")),
    ]


def _once(stmt: str, g: dict, n: int = 2000) -> float:
    return timeit.timeit(stmt, globals=g, number=n) / n * 1e9


if __name__ == "__main__":
    main()
