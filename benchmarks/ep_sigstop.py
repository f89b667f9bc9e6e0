"""Expert parallelism alone, one rank SIGSTOPped 30 % of each 100 ms: how long until it is
flagged, and is it the only one.

    python benchmarks/ep_sigstop.py --runs 5

Each run: a real ``rankwatch agent`` and the harness on two ranks (``--ep 2 --experts 4``,
gloo), 160 clean steps (no straggler may be flagged there), then a duty cycle from outside on
rank 1 (stopped 30 ms of every 100 ms).  Most stops land in the all-to-all waits, where both
ranks are blocked alike, so the victim's own work barely grows; what shows it is that it
leaves the stopped collective late and arrives late at the next one (its late arrival,
``agent/detect/late_arrival.py``).  Prints each run's seconds from the cycle's start to the
flag (or "none" within ``--limit``), the flagged ranks and causes, and the median.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import AgentProcess, torchrun, wait_for  # noqa: E402
from test_e2e_pipeline_experts import DutyCycle, _stop, _stragglers  # noqa: E402

VICTIM = 1


def one_run(limit: float) -> tuple[float | None, list, list]:
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        agent = AgentProcess(tmp_path / "agent.sock").start()
        job = torchrun(2, "--ep", "2", "--experts", "4", "--steps", "100000", agent=agent.addr,
                       log=tmp_path / "job.log")
        duty = None
        try:
            def clean():
                s = agent.status()
                return s if len(s["ranks"]) == 2 and min(r["step"] for r in s["ranks"]) >= 160 else None

            s = wait_for(clean, 400, 1.0, "160 clean steps")
            false = _stragglers(s)
            pid = next(r["pid"] for r in s["ranks"] if r["rank"] == VICTIM)
            duty = DutyCycle(pid, stop=0.03, period=0.1)
            t0 = time.monotonic()
            duty.start()
            try:
                flagged = wait_for(lambda: _stragglers(agent.status())[len(false):], limit, 0.2, "flag")
            except TimeoutError:
                return None, false, []
            return time.monotonic() - t0, false, flagged
        finally:
            if duty is not None:
                duty.end()
            _stop(job)
            agent.stop()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--limit", type=float, default=90.0)
    args = p.parse_args()
    times = []
    for i in range(args.runs):
        took, false, flagged = one_run(args.limit)
        print(f"run {i + 1}: flagged after {'none' if took is None else f'{took:.1f} s'}: {flagged}; "
              f"in the clean steps: {false or 'nothing'}", flush=True)
        if took is not None and [rank for rank, _ in flagged] == [VICTIM]:
            times.append(took)
    print(f"victim flagged alone in {len(times)} of {args.runs} runs; median "
          f"{statistics.median(times):.1f} s" if times else f"flagged alone in 0 of {args.runs} runs")


if __name__ == "__main__":
    main()
