"""Detector cost curve: CPU time of one evaluation against the number of ranks.

    python benchmarks/detectors.py [--ranks 8 32 128 512 1024] [--repeats 9]

Synthetic ranks (no processes): each rank has the 64 recent steps the agent
keeps, with 5 % noise.  For each size, the median over ``--repeats`` of the
process CPU time per call of:

* ``detect_hang`` with every rank progressing (the common case) and with the
  job stalled (a culprit to localise over 4 process groups, or with ``--layout 3d``
  over a world group, a tensor-parallel group per node of 8 and 8 data-parallel
  groups: thousands of groups at thousands of ranks, each node's ranks waiting in
  their own group's collective);
* ``StragglerDetector.update`` on a clean job (new steps each call), and with
  one rank flagged (scores and hysteresis run on every call);
* ``score``, which the agent also calls once per evaluation for the slowdown gauge.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np

from rankwatch.agent.detect.hang_verdict import HangConfig, RankProgress, detect_hang
from rankwatch.agent.detect.straggler import RankWork, StragglerConfig, StragglerDetector, score

KEEP = 64


def _cpu_per_call(fn: Callable[[int], object], calls: int, repeats: int) -> float:
    """Median over repeats of the CPU seconds per call; ``fn(i)`` is call i."""
    per = []
    i = 0
    for _ in range(repeats):
        t0 = time.process_time()
        for _ in range(calls):
            fn(i)
            i += 1
        per.append((time.process_time() - t0) / calls)
    return statistics.median(per)


def _progress(n: int, now: float, stalled: bool, layout: str = "flat") -> list[RankProgress]:
    out = []
    for r in range(n):
        if layout == "3d":
            seqs, waits = {"world": 1000, f"tp{r // 8}": 1000, f"dp{r % 8}": 1000}, f"tp{r // 8}"
        else:
            seqs, waits = {f"pg{g}": 1000 for g in range(4)}, "pg2"
        if stalled and r == n // 2:
            seqs[waits] = 999
        out.append(RankProgress(rank=r, node=f"n{r // 8}", step=500, step_seconds=0.1,
                                steps_completed=500, activity="train",
                                progress_at=now - (30.0 if stalled else 0.05), last_seen=now - 0.05,
                                connected=True, group_seqs=seqs,
                                inflight={"op": "all_reduce", "group": waits, "seq": 1000, "since": now - 30}))
    return out


def _work_stream(n: int, calls: int, slow_rank: int | None, rng: np.random.Generator) -> list[list[RankWork]]:
    """Per call, the ranks' windows one step later than the call before."""
    steps = KEEP + calls
    own = 0.1 * (1 + 0.05 * rng.standard_normal((n, steps)))
    if slow_rank is not None:
        own[slow_rank] *= 1.3
    out = []
    for c in range(calls):
        t = KEEP + c
        out.append([RankWork(rank=r, node=f"n{r // 8}", step=t, own=own[r, t - KEEP:t].tolist(),
                             data=[0.001] * KEEP, wait=[0.01] * KEEP, delay=[0.0] * KEEP,
                             step_seconds=0.12, completed=t) for r in range(n)])
    return out


def measure(n: int, repeats: int, rng: np.random.Generator, layout: str = "flat",
            hang_only: bool = False) -> dict[str, float]:
    cfg_h = HangConfig()
    now = time.time()
    ok, stalled = _progress(n, now, False, layout), _progress(n, now, True, layout)
    verdict = detect_hang(now, stalled, cfg_h)
    assert verdict is not None and verdict.culprit.rank == n // 2, "the stalled job's culprit"
    calls = max(3, 2000 // n)
    row = {
        "hang_ok": _cpu_per_call(lambda i: detect_hang(now, ok, cfg_h), calls, repeats),
        "hang_stalled": _cpu_per_call(lambda i: detect_hang(now, stalled, cfg_h), calls, repeats),
    }
    if hang_only:
        return row
    cfg = StragglerConfig(warmup_steps=0)
    for name, slow in (("straggler_clean", None), ("straggler_flagged", n // 3)):
        warm = 60  # calls before timing: the slow rank gets flagged in these
        stream = _work_stream(n, warm + calls * repeats, slow, rng)
        det = StragglerDetector(cfg)
        for ranks in stream[:warm]:
            det.update(ranks)
        assert (slow in det.flagged) if slow is not None else not det.flagged, name
        row[name] = _cpu_per_call(lambda i: det.update(stream[warm + i]), calls, repeats)
    clean = _work_stream(n, 1, None, rng)[0]
    row["score"] = _cpu_per_call(lambda i: score(clean, cfg), calls, repeats)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 32, 128, 512, 1024])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--layout", choices=("flat", "3d"), default="flat",
                    help="process groups: 4 over every rank, or world + per-node TP + 8 DP groups")
    ap.add_argument("--hang-only", action="store_true", help="only the hang detector's columns")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    cols: tuple[str, ...] = ("hang_ok", "hang_stalled")
    if not args.hang_only:
        cols += ("straggler_clean", "straggler_flagged", "score")
    print("| ranks | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for n in args.ranks:
        row = measure(n, args.repeats, rng, args.layout, args.hang_only)
        print(f"| {n} | " + " | ".join(f"{row[c] * 1e3:.3f} ms" for c in cols) + " |", flush=True)


if __name__ == "__main__":
    main()
