"""Steady-state cost of the harness's default peer snapshots, against an A/A control.

Three torchrun "nodes" of one rank on this machine (c10d rendezvous, plain FSDP2 over the
three ranks, the harness's default model), so that the defaults apply: in-process recovery
on, peer snapshots on with the ``K`` each job chooses for itself.  Three arms run in a new
random order in every round, so that every arm sees the same machine:

* ``default``: no flag (snapshots as planned, ``K`` read from the job's log);
* ``off`` and ``off'``: ``--snapshot-every off``, the tier still on; two identical arms
  whose difference is the noise floor.

An arm's figure is the median over its runs of the run's mean step period after the
warm-up (wall time over steps from the steps' starts, so that the 1 step in ``K`` that
snapshots counts in full).

    python benchmarks/default_snapshot_cost.py --rounds 5 --steps 300
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

NODES = 3
WARM_UP = 40
_PLAN = re.compile(r"rankwatch: peer snapshots every (\d+) steps")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(steps: int, flags: list[str], out: Path) -> tuple[float, list[int]]:
    """One job: its mean step period after the warm-up (the ranks' mean), and the K its ranks chose."""
    out.mkdir(parents=True, exist_ok=True)
    port = _port()
    procs = []
    for node in range(NODES):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES), "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "cost",
               "--rdzv-conf", f"is_host={int(node == 0)}", "-m", "rankwatch.hooks.train", "--steps", str(steps),
               "--log-every", "0", "--no-rankwatch", "--metrics-out", str(out), *flags]
        log = open(out / f"n{node}.log", "w")
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                      env={**os.environ, "OMP_NUM_THREADS": "1", "RANKWATCH_NODE_ID": f"n{node}"}))
    for p in procs:
        if p.wait(900) != 0:
            raise RuntimeError(f"a node failed: see {out}")
    periods = []
    for rank in range(NODES):
        starts = json.loads((out / f"rank{rank}.json").read_text())["step_starts"][WARM_UP:]
        periods.append((starts[-1] - starts[0]) / (len(starts) - 1))
    ks = [int(k) for node in range(NODES) for k in _PLAN.findall((out / f"n{node}.log").read_text())]
    return statistics.fmean(periods), ks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=300)
    args = p.parse_args()
    arms = {"default": [], "off": ["--snapshot-every", "off"], "off'": ["--snapshot-every", "off"]}
    got: dict[str, list[float]] = {a: [] for a in arms}
    chosen: list[int] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = list(arms)
            random.shuffle(order)
            for i, arm in enumerate(order):
                period, ks = run(args.steps, arms[arm], Path(tmp) / f"{r}-{i}")
                got[arm].append(period)
                if arm == "default":
                    chosen += ks[-NODES:]
            print(f"round {r + 1}: " + ", ".join(f"{a} {got[a][-1] * 1e3:.2f} ms" for a in arms)
                  + f"; K chosen {chosen[-NODES:]}", flush=True)
    base = statistics.median(got["off"])
    print(f"\n| arm | step period (median of {args.rounds} runs' means) | vs off |\n|---|---|---|")
    for arm, times in got.items():
        m = statistics.median(times)
        print(f"| {arm} | {m * 1e3:.2f} ms ({min(times) * 1e3:.2f}-{max(times) * 1e3:.2f}) | "
              f"{(m / base - 1) * 100:+.2f} % |")
    print(f"K chosen (last plan of each rank, every default run): {sorted(chosen)}")


if __name__ == "__main__":
    main()
