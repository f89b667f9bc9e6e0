"""Replay recorded noise through the straggler detector: false positives and detection latency.

    python benchmarks/replay.py --data benchmarks/data/noise.npz --steps 100000

The recording (``benchmarks/noise.py record``) holds real clean runs: per rank
and step, own work, data wait, collective wait and run delay.  For each rank
count recorded, the replay builds a job of that many ranks: segments of
``--segment`` steps cut at random offsets of random runs, each segment's ranks
from one run and permuted at random, so a replay of 100,000 steps never
repeats a sequence and keeps what a job's ranks share.  Steps reach the detector in batches, as the
agent's 4 Hz evaluation sees them.

* clean: every flag is a false positive;
* injected: from a random onset, one rank's own work grows by LEVEL x its
  recorded median (the same rank's noise stays on top); a flag of that rank at
  or after onset is a detection, any other flag a false positive.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from noise import load_runs
from rankwatch.agent.detect.straggler import RankWork, StragglerConfig, StragglerDetector

KEEP = 64  # steps of history the agent keeps per rank


@dataclass
class Trace:
    """A replayed job: (ranks, steps) arrays."""

    own: np.ndarray
    data: np.ndarray
    delay: np.ndarray


def build(runs: list[dict[str, np.ndarray]], steps: int, segment: int,
          rng: np.random.Generator) -> Trace:
    """Tile segments of random runs (all with the same ranks), ranks permuted, into one job.

    Every segment's ranks come from one run, so what the ranks of a real job
    share (a slow moment of the whole host) stays shared in the replay.
    """
    ranks = runs[0]["own"].shape[0]
    cols = {c: np.empty((ranks, steps)) for c in ("own", "data", "delay")}
    for start in range(0, steps, segment):
        n = min(segment, steps - start)
        run = runs[rng.integers(len(runs))]
        off = int(rng.integers(0, max(1, run["own"].shape[1] - n)))
        order = rng.permutation(ranks)
        for c in cols:
            cols[c][:, start:start + n] = run[c][order, off:off + n]
    return Trace(**cols)


def inject(trace: Trace, rank: int, onset: int, level: float, kind: str = "compute") -> Trace:
    own, data = trace.own.copy(), trace.data.copy()
    extra = level * float(np.median(trace.own[rank]))
    own[rank, onset:] += extra
    if kind == "data":
        data[rank, onset:] += extra
    return Trace(own=own, data=data, delay=trace.delay)


def replay(trace: Trace, cfg: StragglerConfig, stride: int) -> Iterator[tuple[int, list]]:
    """Feed the detector ``stride`` steps at a time; yield (step, events) where there are events."""
    det = StragglerDetector(cfg)
    n_ranks, steps = trace.own.shape
    for t in range(stride, steps + 1, stride):
        lo = max(0, t - KEEP)
        work = [RankWork(rank=r, node="n0", step=t, own=trace.own[r, lo:t].tolist(),
                         data=trace.data[r, lo:t].tolist(), wait=[0.0] * (t - lo),
                         delay=trace.delay[r, lo:t].tolist(),
                         step_seconds=float(trace.own[r, lo:t].mean()) * 1.5, completed=t)
                for r in range(n_ranks)]
        events = det.update(work, t)
        if events:
            yield t, events


def false_positives(runs: list[dict], cfg: StragglerConfig, steps: int, segment: int,
                    stride: int, seed: int) -> tuple[int, list]:
    trace = build(runs, steps, segment, np.random.default_rng(seed))
    flags = [(t, ev.score.cause, round(ev.score.slowdown, 2)) for t, evs in replay(trace, cfg, stride)
             for ev in evs if ev.kind == "flagged"]
    return len(flags), flags[:10]


def detections(runs: list[dict], cfg: StragglerConfig, level: float, trials: int,
               stride: int, seed: int, kind: str = "compute") -> dict:
    """``trials`` short jobs, each with one rank slowed from a random onset."""
    rng = np.random.default_rng(seed)
    latencies, missed, fp, causes = [], 0, 0, {}
    horizon = 200
    for _ in range(trials):
        onset = int(rng.integers(cfg.warmup_steps + cfg.window + 20, 200))
        victim = int(rng.integers(runs[0]["own"].shape[0]))
        trace = inject(build(runs, onset + horizon, 128, rng), victim, onset, level, kind)
        hit = None
        for t, events in replay(trace, cfg, stride):
            for ev in events:
                if ev.kind != "flagged":
                    continue
                if victim in ev.ranks and t >= onset:
                    hit = hit or (t - onset, ev.score.cause)
                else:
                    fp += 1
            if hit:
                break
        if hit is None:
            missed += 1
        else:
            latencies.append(hit[0])
            causes[hit[1]] = causes.get(hit[1], 0) + 1
    tp = len(latencies)
    return {"level": level, "trials": trials, "recall": tp / trials,
            "precision": tp / (tp + fp) if tp + fp else float("nan"),
            "median_latency": statistics.median(latencies) if latencies else None,
            "p90_latency": float(np.percentile(latencies, 90)) if latencies else None,
            "false_positives": fp, "causes": causes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=Path(__file__).parent / "data" / "noise.npz")
    ap.add_argument("--steps", type=int, default=100_000, help="clean steps replayed per rank count")
    ap.add_argument("--segment", type=int, default=256)
    ap.add_argument("--stride", type=int, default=0, help="steps per evaluation (0: as at 4 Hz)")
    ap.add_argument("--trials", type=int, default=100, help="injected jobs per level and rank count")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--evidence", type=float, default=None, help="override StragglerConfig.evidence")
    ap.add_argument("--only-ranks", type=int, default=None, help="replay only runs of this many ranks")
    args = ap.parse_args()
    cfg = StragglerConfig(**({"evidence": args.evidence} if args.evidence else {}))
    by_ranks: dict[int, list[dict]] = {}
    for run in load_runs(args.data):
        by_ranks.setdefault(run["own"].shape[0], []).append(run)
    for ranks, runs in sorted(by_ranks.items()):
        if args.only_ranks and ranks != args.only_ranks:
            continue
        step_seconds = float(np.median([np.median(r["own"] + r["wait"]) for r in runs]))
        stride = args.stride or max(1, round(0.25 / step_seconds))
        print(f"{ranks} ranks: {len(runs)} recorded runs, {sum(r['own'].shape[1] for r in runs)} steps; "
              f"median step {step_seconds * 1e3:.1f} ms, {stride} steps per evaluation", flush=True)
        n, first = false_positives(runs, cfg, args.steps, args.segment, stride, args.seed)
        print(f"| clean replay, {ranks} ranks | {args.steps} steps | false positives {n} {first} |", flush=True)
        for level in (0.05, 0.10, 0.25, 0.50):
            d = detections(runs, cfg, level, args.trials, stride, args.seed + 1)
            print(f"| {level:.0%}, {ranks} ranks | recall {d['recall']:.2f} | precision {d['precision']:.2f} | "
                  f"latency median {d['median_latency']} p90 {d['p90_latency']} steps | "
                  f"causes {d['causes']} |", flush=True)


if __name__ == "__main__":
    main()
