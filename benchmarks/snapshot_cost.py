"""Steady-state cost of peer snapshots (``--snapshot-every K``), against an A/A control.

The same job (three ranks under ``torchrun --standalone``, plain FSDP2, the in-process tier
on) runs once per arm in each round, the arms in a new random order every round, so that
every arm sees the same machine.  An arm's figure is the median over its runs of the run's
mean step period after the warm-up (wall time over steps, from the steps' starts, so that a
snapshot every K steps counts in full: a median step would leave the 1 in K steps that copy
out).  Two arms without snapshots (``A`` and ``A'``)
show the noise floor: a cost below their difference is not resolved.

    python benchmarks/snapshot_cost.py --rounds 5 --steps 300 --ks 1,10,50,100
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

NPROC = 3
WARM_UP = 20


def run(steps: int, every: int, out: Path) -> float:
    """One run's mean step period after the warm-up, seconds (the ranks' mean)."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(NPROC),
           "-m", "rankwatch.hooks.train", "--steps", str(steps), "--log-every", "0", "--no-rankwatch",
           "--in-process-recovery", "--snapshot-every", str(every), "--metrics-out", str(out)]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=900)
    periods = []
    for rank in range(NPROC):
        starts = json.loads((out / f"rank{rank}.json").read_text())["step_starts"][WARM_UP:]
        periods.append((starts[-1] - starts[0]) / (len(starts) - 1))
    return statistics.fmean(periods)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--ks", default="1,10,50,100", help="snapshot intervals to measure, comma-separated")
    args = p.parse_args()
    arms = {"A": 0, "A'": 0, **{f"K={k}": int(k) for k in args.ks.split(",")}}
    got: dict[str, list[float]] = {a: [] for a in arms}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = list(arms)
            random.shuffle(order)
            for i, arm in enumerate(order):
                got[arm].append(run(args.steps, arms[arm], Path(tmp) / f"{r}-{i}"))
            print(f"round {r + 1}: " + ", ".join(f"{a} {got[a][-1] * 1e3:.1f} ms" for a in arms), flush=True)
    base = statistics.median(got["A"])
    print(f"\n| arm | step period (median of {args.rounds} runs' means) | vs A |\n|---|---|---|")
    for arm, times in got.items():
        m = statistics.median(times)
        print(f"| {arm} | {m * 1e3:.1f} ms ({min(times) * 1e3:.1f}-{max(times) * 1e3:.1f}) | "
              f"{(m / base - 1) * 100:+.1f} % |")


if __name__ == "__main__":
    main()
