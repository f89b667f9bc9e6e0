"""Live and offline agree: a real harness job under ``rankwatch run`` with one rank slowed,
watched by a real agent that keeps its step history; then ``rankwatch analyze`` over the
agent's state directory names the same straggler, with the same cause, at the same onset
as the live incident (issue 58).

Tolerance on the onset step.  Both sides run the same detector, but not on the same clock:

* the live one runs on the agent's tick (every 0.25 s) over every step completed since the
  last, and reads the ranks' late arrivals only once they settle (0.5 s after a collective
  completes): it flags up to ``(0.25 + 0.5) / step`` steps after the step whose data met its
  conditions;
* ``analyze`` holds a slowdown for a tenth of the recording's time where that is less than the
  live 2 s (``offline_config``): it may flag ``(2 - hold) / step`` steps sooner;
* and one window (``StragglerConfig.window``, the steps an estimate spans) for evidence that
  only one side had seen settled when it decided.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import AgentProcess
from rankwatch.agent.detect.work_scores import StragglerConfig

pytestmark = pytest.mark.e2e

ONSET = 80
STEPS = 600
_TICK, _SETTLE = 0.25, 0.5   # the agent's detector tick and the arrivals' settling time (seconds)


def _record(tmp_path: Path, fault: str) -> tuple[AgentProcess, dict]:
    """Run the harness with ``fault`` under ``rankwatch run`` against a real agent (its state
    directory kept); return the agent, stopped (its history written out), and its last live view."""
    agent = AgentProcess(tmp_path / "agent.sock").start()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        with open(tmp_path / "job.log", "w") as log:
            job = subprocess.run(
                [sys.executable, "-m", "rankwatch.agent.cli", "run", "--agent", str(agent.addr), "--",
                 "--standalone", "--nproc-per-node", "2", "-m", "rankwatch.hooks.train", "--steps", str(STEPS),
                 "--log-every", "0", "--fault", fault],
                env=env, stdout=log, stderr=subprocess.STDOUT, timeout=400)
        assert job.returncode == 0, (tmp_path / "job.log").read_text()[-3000:]
        live = agent.status()
    finally:
        agent.stop()   # SIGTERM: the agent writes out what its history holds
    return agent, live


def _analyze(state_dir: Path) -> dict:
    out = subprocess.run([sys.executable, "-m", "rankwatch.agent.cli", "analyze", str(state_dir), "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def _stragglers(incidents: list[dict], since: int = 0) -> list[dict]:
    return [i for i in incidents if i["kind"] == "straggler" and i["step"] >= since]


@pytest.mark.parametrize("fault,rank,cause", [("slow_compute", 1, "compute"), ("slow_data", 0, "data")])
def test_analyze_over_the_state_directory_agrees_with_the_live_agent(tmp_path, fault, rank, cause):
    agent, live = _record(tmp_path, f"{fault}:{rank}:{ONSET}:0.5")
    state_dir = tmp_path / "state-n0"
    assert live["storage"]["history"]["written"] > 0 and live["storage"]["history"]["dropped"] == 0, live["storage"]
    offline = _analyze(state_dir)

    live_flags, off_flags = _stragglers(live["incidents"], ONSET), _stragglers(offline["incidents"], ONSET)
    assert live_flags and off_flags, (live["incidents"], offline["incidents"])
    first_live, first_off = live_flags[0], off_flags[0]
    assert (first_live["rank"], first_live["detail"]["cause"]) == (rank, cause), first_live
    assert (first_off["rank"], first_off["detail"]["cause"]) == (rank, cause), (first_off, first_live)
    assert {i["rank"] for i in live_flags} == {i["rank"] for i in off_flags} == {rank}, (live_flags, off_flags)

    step_seconds = first_live["detail"]["cost"]["step_seconds"]
    live_hold = StragglerConfig().hold_seconds
    offline_hold = min(live_hold, offline["steps"] * offline["step_seconds"] / 10)
    slack = math.ceil((_TICK + _SETTLE + live_hold - offline_hold) / step_seconds) + StragglerConfig().window
    print(f"{fault}: live onset step {first_live['step']}, analyze's {first_off['step']} (slack {slack}); "
          f"slowdown {first_live['detail']['slowdown']} / {first_off['detail']['slowdown']}; "
          f"{live['storage']['history']['written']} rows of {offline['ranks']} x {offline['steps']} rank-steps, "
          f"{sum(p.stat().st_size for p in (state_dir / 'history').iterdir())} bytes")
    assert abs(first_off["step"] - first_live["step"]) <= slack, (first_off["step"], first_live["step"], slack)
    assert first_off["detail"]["slowdown"] >= 1.3 and first_live["detail"]["slowdown"] >= 1.3
    assert offline["ranks"] == 2 and offline["steps"] >= STEPS - 10, {k: offline[k] for k in ("ranks", "steps")}
