"""Straggler detection on real jobs: recall, precision and latency per slowdown level.

    python benchmarks/stragglers.py --levels 0 --runs 3 --steps 400        # clean runs
    python benchmarks/stragglers.py --levels 0.25 0.5 --runs 3 --steps 250
    python benchmarks/stragglers.py --levels 0.25 --inject sigstop

Each run is a real ``rankwatch agent`` and a 2-rank FSDP2 torchrun job (the
harness on gloo).  From step ``ONSET`` rank 1 is slowed by LEVEL x its usual
own work, in one of two ways:

* ``--inject fault`` (default): the harness's ``--fault slow_compute``, a sleep
  of LEVEL x the rank's usual step time in its forward;
* ``--inject sigstop``: from outside, this process SIGSTOPs and SIGCONTs the
  worker on a duty cycle, stopped LEVEL / (1 + LEVEL) of each 100 ms.

Labelling: a ``straggler`` incident for rank 1 at or after onset is a true
positive (its latency is the incident's step minus onset); every other
straggler incident, and every incident of a clean run (LEVEL 0), is a false
positive.  Per level: recall = runs with a detection / runs, precision =
detections / all incidents, and the median latency over the detections.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import AgentProcess, torchrun, wait_for  # noqa: E402

ONSET = 100
VICTIM = 1
_PERIOD = 0.1


def _duty_cycle(pid: int, level: float, stop: threading.Event) -> None:
    off = _PERIOD * level / (1 + level)
    while not stop.is_set():
        try:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(off)
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            return
        time.sleep(_PERIOD - off)


def one(tmp: Path, name: str, steps: int, level: float, inject: str) -> list[dict]:
    """One job; returns its straggler incidents."""
    agent = AgentProcess(tmp / f"{name}.sock").start()
    fault = ("--fault", f"slow_compute:{VICTIM}:{ONSET}:{level}") if level and inject == "fault" else ()
    job = torchrun(2, "--steps", str(steps), "--log-every", "0", *fault, agent=agent.addr,
                   log=tmp / f"{name}.log")
    stop, pids = threading.Event(), {}
    try:
        if level and inject == "sigstop":
            ranks = wait_for(lambda: [r for r in agent.status()["ranks"] if r["rank"] == VICTIM
                                      and r["step"] >= ONSET], 300, interval=0.02, what="onset")
            threading.Thread(target=_duty_cycle, args=(ranks[0]["pid"], level, stop), daemon=True).start()
        while job.poll() is None:
            pids = {r["rank"]: r["pid"] for r in agent.status()["ranks"]} or pids
            time.sleep(0.5)
        return [i for i in agent.status()["incidents"] if i["kind"] == "straggler"]
    finally:
        stop.set()
        for pid in pids.values():
            try:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)  # workers run in sessions of their own
            except ProcessLookupError:
                pass
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
        job.wait(30)
        agent.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--levels", type=float, nargs="+", default=[0.0, 0.05, 0.10, 0.25, 0.50])
    ap.add_argument("--inject", choices=["fault", "sigstop"], default="fault")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmpdir:
        for level in args.levels:
            tp, fp, lat, causes = 0, 0, [], {}
            for i in range(args.runs):
                incidents = one(Path(tmpdir), f"l{level}-{i}", args.steps, level, args.inject)
                hits = [x for x in incidents if level and x["rank"] == VICTIM and x["step"] >= ONSET]
                fp += len(incidents) - len(hits)
                if hits:
                    tp += 1
                    lat.append(hits[0]["step"] - ONSET)
                    cause = hits[0]["detail"]["cause"]
                    causes[cause] = causes.get(cause, 0) + 1
                print(f"  level {level:.0%} run {i}: " + ", ".join(
                    f"rank {x['rank']} step {x['step']} {x['detail']['cause']} x{x['detail']['slowdown']}"
                    for x in incidents), flush=True)
            if not level:
                print(f"| none ({args.runs} clean runs x {args.steps} steps) | | false positives {fp} | |")
                continue
            prec = tp / (tp + fp) if tp + fp else float("nan")
            print(f"| {level:.0%} ({args.inject}) | recall {tp}/{args.runs} | precision {prec:.2f} | "
                  f"latency {statistics.median(lat) if lat else '-'} steps (median; {sorted(lat)}) | "
                  f"causes {causes} |", flush=True)


if __name__ == "__main__":
    main()
