"""Checkpoint stall: synchronous DCP saves against asynchronous ones (``dcp.async_save``).

Two ranks under torchrun (gloo, FSDP2), a model large enough that a save takes
a while on this machine, a save every ``--interval`` steps.  Each repetition
runs both modes back to back (the order alternates), so the ratio is measured
under the same load.  Per save, from rank 0's ``--metrics-out``:

* ``blocked``: seconds the training thread spent on it (the stall);
* ``complete``: seconds until it was complete on disk (``COMPLETE`` written).

    python benchmarks/checkpoint.py --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MODEL = ("--dim", "256", "--layers", "4", "--heads", "4", "--hidden-dim", "1024", "--vocab", "8192")


def run(mode: str, steps: int, interval: int, workdir: Path) -> dict:
    out = workdir / f"out-{mode}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "rankwatch.hooks.train", "--steps", str(steps), "--log-every", "0", "--no-rankwatch",
           "--checkpoint-dir", str(workdir / f"ck-{mode}"), "--checkpoint-interval", str(interval),
           "--metrics-out", str(out), *MODEL, *(["--checkpoint-sync"] if mode == "sync" else [])]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    m = json.loads((out / "rank0.json").read_text())
    saves = [s for s in m["checkpoints"] if s["ok"]]
    saved_steps = {s["step"] for s in saves}
    plain = [t for i, t in enumerate(m["step_times"], start=m["start"] + 1) if i not in saved_steps]
    return {"blocked": [s["blocked"] for s in saves], "complete": [s["completed_after"] for s in saves],
            "step": statistics.median(plain)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--interval", type=int, default=5)
    args = p.parse_args()
    got: dict[str, dict[str, list[float]]] = {m: {"blocked": [], "complete": [], "step": []}
                                              for m in ("sync", "async")}
    ratios = []
    for rep in range(args.reps):
        modes = ("sync", "async") if rep % 2 == 0 else ("async", "sync")
        with tempfile.TemporaryDirectory(prefix="rankwatch-ckbench-") as d:
            r = {mode: run(mode, args.steps, args.interval, Path(d)) for mode in modes}
        for mode in modes:
            got[mode]["blocked"] += r[mode]["blocked"]
            got[mode]["complete"] += r[mode]["complete"]
            got[mode]["step"].append(r[mode]["step"])
        ratios.append(statistics.median(r["sync"]["blocked"]) / statistics.median(r["async"]["blocked"]))
        print(f"rep {rep}: sync stall {statistics.median(r['sync']['blocked']) * 1e3:.1f} ms, "
              f"async stall {statistics.median(r['async']['blocked']) * 1e3:.1f} ms", flush=True)
    print("| mode | saves | training-thread stall, median | complete on disk after, median "
          "| step without a save, median |")
    print("|---|---|---|---|---|")
    for mode in ("sync", "async"):
        g = got[mode]
        print(f"| {mode} | {len(g['blocked'])} | {statistics.median(g['blocked']) * 1e3:.1f} ms "
              f"| {statistics.median(g['complete']) * 1e3:.1f} ms | {statistics.median(g['step']) * 1e3:.1f} ms |")
    print(f"stall ratio sync/async, median of {len(ratios)} paired runs: {statistics.median(ratios):.1f}x "
          f"({min(ratios):.1f}-{max(ratios):.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
