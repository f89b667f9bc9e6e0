"""Record per-rank, per-step noise from real clean jobs into benchmarks/data/*.npz.

    python benchmarks/noise.py record --runs 3 --steps 600 --nproc 2 --out benchmarks/data/noise.npz

A real torchrun job (the harness, gloo) streams to an agent that runs in this
process, so every step of every rank can be read off the agent's state: own
work, data-loader wait, collective wait, the training thread's run delay
(:mod:`rankwatch.agent.node.starvation`) and the step's start time (Unix seconds,
kept relative to the run's first step).  Each run is appended to the file as
``run<i>_<column>`` arrays of shape (ranks, steps), float32, plus
``run<i>_step_seconds``.  :func:`load_runs` reads them back for the replay in
``benchmarks/stragglers.py replay``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import torchrun  # noqa: E402

from rankwatch.address import Address  # noqa: E402
from rankwatch.agent.server import Agent, AgentConfig  # noqa: E402
from rankwatch.agent.node.starvation import StarvationTracker  # noqa: E402

COLUMNS = ("own", "data", "wait", "delay", "start")
_POLL_SECONDS = 0.04


def record_run(tmp: Path, nproc: int, steps: int, harness: list[str]) -> dict[str, np.ndarray]:
    """One clean job; returns ``{column: (ranks, steps) array}`` of every step after the first."""
    agent = Agent(AgentConfig(node_id="n0", listen=[Address(path=str(tmp / "agent.sock"))],
                              metrics_port=None))
    agent.start()
    job = torchrun(nproc, "--steps", str(steps), "--log-every", "0", *harness,
                   agent=agent.config.listen[0], log=tmp / "job.log")
    rows: dict[int, dict[str, list[float]]] = {}
    seen: dict[int, int] = {}
    delays = StarvationTracker(maxlen=4096)
    starts: dict[int, list[float]] = {}
    agent.state.step_listeners.append(lambda rank, steps: starts.setdefault(rank.rank, []).extend(steps.start))
    try:
        while True:
            finished = job.poll() is not None
            _poll(agent, rows, seen, None if finished else delays)
            if finished:
                break
            time.sleep(_POLL_SECONDS)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(30)
        agent.stop()
    if job.returncode != 0:
        raise RuntimeError(f"job failed ({job.returncode}); see {tmp / 'job.log'}")
    t0 = min(s[0] for s in starts.values())
    for rank, row in rows.items():
        row["delay"] = delays.per_step(rank) or []
        row["start"] = [t - t0 for t in starts.get(rank, [])]
    n = min(min(len(row[c]) for c in COLUMNS) for row in rows.values())
    if n == 0:
        raise RuntimeError("no step was recorded with its run delay")
    return {c: np.array([rows[r][c][len(rows[r][c]) - n:] for r in sorted(rows)],
                        np.float64 if c == "start" else np.float32) for c in COLUMNS}


def _poll(agent: Agent, rows: dict, seen: dict, delays: StarvationTracker | None) -> None:
    """Copy every rank's steps completed since the last poll (the agent keeps 64), and
    sample run delay unless ``delays`` is None (the job has exited: its pids are gone)."""
    with agent.state.lock:
        ranks = list(agent.state.ranks.values())
        for r in ranks:
            new = r.steps_completed - seen.get(r.rank, 0)
            if new <= 0:
                continue
            if new > len(r.own_work):
                raise RuntimeError("the poll fell behind the agent's window; poll faster")
            row = rows.setdefault(r.rank, {c: [] for c in COLUMNS})
            for col, src in (("own", r.own_work), ("data", r.data_wait), ("wait", r.comm_wait)):
                row[col] += list(src)[-new:]
            seen[r.rank] = r.steps_completed
    for r in ranks if delays is not None else ():
        delays.sample(r.rank, r.pid, r.steps_completed)


def load_runs(path: Path) -> list[dict[str, np.ndarray]]:
    """The runs in a recording, each ``{column: (ranks, steps) float64 array}`` (NaN where
    a run lacks a column)."""
    with np.load(path) as z:
        ids = sorted({k.split("_", 1)[0] for k in z.files})
        runs = []
        for i in ids:
            shape = z[f"{i}_own"].shape
            runs.append({c: z[f"{i}_{c}"].astype(np.float64) if f"{i}_{c}" in z.files
                         else np.full(shape, np.nan) for c in COLUMNS})
        return runs


def append_runs(path: Path, runs: list[dict[str, np.ndarray]]) -> None:
    old = {}
    if path.exists():
        with np.load(path) as z:
            old = {k: z[k] for k in z.files}
    start = len({k.split("_", 1)[0] for k in old})
    for i, run in enumerate(runs, start):
        for c in COLUMNS:
            old[f"run{i:03d}_{c}"] = run[c] if c != "start" else run[c].astype(np.float64)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, **old)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("command", choices=["record"])
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("harness", nargs="*", help="extra harness flags (after --)")
    args = ap.parse_args()
    for i in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            run = record_run(Path(tmp), args.nproc, args.steps, args.harness)
        append_runs(args.out, [run])
        own = run["own"]
        print(f"run {i}: {own.shape[0]} ranks x {own.shape[1]} steps, median own work "
              f"{np.median(own) * 1e3:.1f} ms, median run delay {np.median(run['delay']) * 1e3:.2f} ms",
              flush=True)


if __name__ == "__main__":
    main()
