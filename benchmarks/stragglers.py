"""Straggler detection on real jobs: recall, precision and latency per slowdown level.

    python benchmarks/stragglers.py [--runs 2] [--steps 400]

A 2-rank FSDP2 job; from step 100 rank 1's forward takes LEVEL x its usual
step time longer (``--fault slow_compute``).  Clean runs count false
positives.  A detection is a straggler incident naming rank 1 at or after
onset; anything else is a false positive.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import AgentProcess, torchrun  # noqa: E402

ONSET = 100


def one(tmp: Path, name: str, steps: int, level: float | None) -> tuple[list[dict], int]:
    agent = AgentProcess(tmp / f"{name}.sock").start()
    fault = ("--fault", f"slow_compute:1:{ONSET}:{level}") if level else ()
    job = torchrun(2, "--steps", str(steps), "--log-every", "0", *fault, agent=agent.addr,
                   log=tmp / f"{name}.log")
    try:
        while job.poll() is None:
            time.sleep(0.5)
        incidents = [i for i in agent.status()["incidents"] if i["kind"] == "straggler"]
        return incidents, steps
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
        agent.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=400)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        fp_clean = 0
        for i in range(args.runs + 1):
            inc, _ = one(tmp, f"clean{i}", args.steps, None)
            fp_clean += len(inc)
        print(f"| clean | {args.runs + 1} runs x {args.steps} steps | false positives {fp_clean} |")
        for level in (0.05, 0.10, 0.25, 0.50):
            tp, fp, lat = 0, 0, []
            for i in range(args.runs):
                inc, _ = one(tmp, f"l{level}-{i}", args.steps, level)
                hits = [x for x in inc if x["rank"] == 1 and x["step"] >= ONSET]
                fp += len(inc) - len(hits)
                if hits:
                    tp += 1
                    lat.append(hits[0]["step"] - ONSET)
            prec = tp / (tp + fp) if tp + fp else float("nan")
            print(f"| {level:.0%} | recall {tp}/{args.runs} | precision {prec:.2f} | "
                  f"latency {statistics.median(lat) if lat else '-'} steps (median) |", flush=True)


if __name__ == "__main__":
    main()
