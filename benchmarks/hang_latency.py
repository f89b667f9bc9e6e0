"""Hang detection latency on real jobs: SIGSTOP one worker, time until the ``hang`` incident.

    python benchmarks/hang_latency.py [--runs 5] [--nproc 2] [--hang-floor 5]

Each run starts a real ``rankwatch agent`` and a 2-rank torchrun job (the
harness on gloo), waits until the ranks are past step 50, SIGSTOPs rank 1's
worker from this process, and polls the agent's status until the ``hang``
incident appears.  The latency is the incident's ``detected_at`` minus the
time of the SIGSTOP (one clock: the same machine).  The job is then killed.
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
from conftest import AgentProcess, torchrun, wait_for  # noqa: E402

VICTIM = 1


def one(tmp: Path, nproc: int, floor: float) -> dict:
    agent = AgentProcess(tmp / "agent.sock", extra=("--hang-floor", str(floor))).start()
    job = torchrun(nproc, "--steps", "100000", "--log-every", "0", agent=agent.addr, log=tmp / "job.log")
    pids: dict[int, int] = {}
    try:
        def running() -> list[dict] | None:
            ranks = agent.status()["ranks"]
            return ranks if len(ranks) == nproc and all(r["step"] >= 50 for r in ranks) else None

        ranks = wait_for(running, 180, what="every rank past step 50")
        pids = {r["rank"]: r["pid"] for r in agent.status()["ranks"]}
        step_seconds = statistics.median(r["step_seconds"] for r in ranks)
        stopped_at = time.time()
        os.kill(pids[VICTIM], signal.SIGSTOP)
        inc = wait_for(lambda: next((i for i in agent.status()["incidents"] if i["kind"] == "hang"), None),
                       floor + 120, interval=0.05, what="hang incident")
        return {"latency": inc["detected_at"] - stopped_at, "culprit": inc["rank"],
                "stopped": inc["detail"].get("stopped"), "step_seconds": step_seconds}
    finally:
        for pid in pids.values():
            try:
                os.kill(pid, signal.SIGKILL)  # workers run in sessions of their own
            except ProcessLookupError:
                pass
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
        job.wait(30)
        agent.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--hang-floor", type=float, default=5.0)
    args = ap.parse_args()
    results = []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            r = one(Path(tmp), args.nproc, args.hang_floor)
        results.append(r)
        print(f"run {i}: detected after {r['latency']:.2f} s; culprit rank {r['culprit']} "
              f"(stopped={r['stopped']}); median step {r['step_seconds'] * 1e3:.1f} ms", flush=True)
    lat = sorted(r["latency"] for r in results)
    right = sum(r["culprit"] == VICTIM for r in results)
    print(f"| {args.runs} runs, floor {args.hang_floor:g} s | median {statistics.median(lat):.2f} s | "
          f"min {lat[0]:.2f} s | max {lat[-1]:.2f} s | culprit right {right}/{args.runs} |")


if __name__ == "__main__":
    main()
