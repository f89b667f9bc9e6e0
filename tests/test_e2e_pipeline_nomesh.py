"""A pipeline job with no DeviceMesh (tests/data/pipeline_job.py): its stages are found anyway.

The script builds two ``torch.distributed.pipelining`` stages over process groups of its own
(GPipe, 4 microbatches), stage 1 about twice stage 0's work (a wider layer and the head).
Under ``rankwatch run`` with no rankwatch import (zero-code), and with ``rw.init()`` and no
mesh, each rank must report its stage, the agent must name stage 1 the heavier with an
imbalance within 15 % of the stages' compute as the script itself measures it, call no rank
a straggler, and count every activation and gradient sent and received.  With two replicas a
stage (world 4), one rank of the heavy stage slowed from outside is flagged, and no other.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import AgentProcess, wait_for
from test_e2e_pipeline_experts import DutyCycle

pytestmark = pytest.mark.e2e

SCRIPT = Path(__file__).parent / "data" / "pipeline_job.py"
MICROBATCHES = 4


def _start(agent: AgentProcess, nproc: int, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "rankwatch.agent.cli", "run", "--agent", str(agent.addr), "--node-id", "n0",
         "--", "--standalone", "--nproc-per-node", str(nproc), str(SCRIPT),
         "--microbatches", str(MICROBATCHES), "--wide", "2", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})


def _stop(job: subprocess.Popen) -> None:
    if job.poll() is None:
        os.killpg(job.pid, signal.SIGTERM)
        try:
            job.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(10)


def _stragglers(status: dict) -> list[tuple[int, str]]:
    return [(i["rank"], i["detail"]["cause"]) for i in status["incidents"] if i["kind"] == "straggler"]


def _live_pipeline(agent: AgentProcess, job: subprocess.Popen, nproc: int, steps: int):
    def seen():
        assert job.poll() is None, f"the job ended before the agent named its pipeline: {agent.status()}"
        s = agent.status()
        ranks = s["ranks"]
        return s if s["pipeline"] and len(ranks) == nproc and min(r["step"] for r in ranks) >= steps else None

    return seen


# 600 steps of ~35 ms (stage 0 ~10 ms of compute, stage 1 ~20 ms) on two CPU ranks: the
# compute outweighs the schedule's own Python (~3 ms a step a stage on a loaded 2-core host),
# which is own work too and pulls the ratio towards 1.
@pytest.mark.parametrize("mode", ["zero_code", "rw_init"])
def test_a_pipeline_without_a_mesh_is_found_balanced_and_counted(tmp_path, mode):
    steps = 600
    agent = AgentProcess(tmp_path / "agent.sock").start()
    job = _start(agent, 2, "--steps", str(steps), "--timing", *(["--rw-init"] if mode == "rw_init" else []))
    try:
        live = wait_for(_live_pipeline(agent, job, 2, 400), 240, 0.5, "the pipeline's balance while it trains")
        out, _ = job.communicate(timeout=240)
        assert job.returncode == 0, out[-3000:]
        end = agent.status()
    finally:
        _stop(job)
        agent.stop()
    compute = {int(s): float(x) for s, x in re.findall(r"compute stage=(\d) seconds=([0-9.]+)", out)}
    assert set(compute) == {0, 1}, out[-3000:]
    measured = compute[1] / compute[0]
    print(f"{mode}: imbalance {live['pipeline']['imbalance']:.2f}, measured compute {compute} ratio {measured:.2f}; "
          f"per step: {[(r['rank'], r['step'], r['op_latency']['send']['count'], r['op_latency']['recv']['count']) for r in end['ranks']]}")
    pipe = live["pipeline"]
    assert (pipe["heaviest_stage"], pipe["lightest_stage"]) == (1, 0), pipe
    assert abs(pipe["imbalance"] / measured - 1) <= 0.15, (pipe["imbalance"], measured, compute)
    assert _stragglers(live) == [] and _stragglers(end) == []
    instrumentation = "auto" if mode == "zero_code" else "explicit"
    ranks = sorted(end["ranks"], key=lambda r: r["rank"])
    assert [(r["mesh"], r["instrumentation"]) for r in ranks] == [({"pp": 0}, instrumentation),
                                                                  ({"pp": 1}, instrumentation)]
    for r in ranks:
        # GPipe: each stage sends one tensor per microbatch (activations forward, gradients
        # back) and receives one; the stage's set-up exchange adds at most a couple.
        done = r["step"]
        assert done >= steps, r
        for op in ("send", "recv"):
            count = r["op_latency"][op]["count"]
            assert MICROBATCHES * steps <= count <= MICROBATCHES * steps + 4, (r["rank"], op, count)
        # The schedule's step is split into its microbatches' forwards and backwards.
        assert r["phase_seconds"]["forward"] > 0 and r["phase_seconds"]["backward"] > 0, r["phase_seconds"]


# Rank 2's stops land mostly in its receives from stage 0, which its replica rank 3 does not
# share: compared by their waits, rank 3 "waited less" and was flagged instead.  With stages,
# the straggler score reads late arrivals at shared collectives only, not the wait difference.
def test_with_replicas_a_stage_rank_slowed_from_outside_is_flagged_alone(tmp_path):
    """World 4, two replicas a stage (ranks 0-1 stage 0, 2-3 stage 1), zero-code: 150 clean
    steps flag nothing and name stage 1 the heavier; then rank 2 (stage 1) is stopped 30 ms
    of every 100 ms: it is flagged, and no other rank."""
    agent = AgentProcess(tmp_path / "agent.sock").start()
    job = _start(agent, 4, "--steps", "100000", "--dp", "2", "--batch", "128")
    duty = None
    try:
        s = wait_for(_live_pipeline(agent, job, 4, 150), 300, 1.0, "150 clean steps")
        assert _stragglers(s) == [], "the heavier stage's ranks were called stragglers"
        ranks = {r["rank"]: r for r in s["ranks"]}
        assert {r: ranks[r]["mesh"] for r in ranks} == {0: {"pp": 0}, 1: {"pp": 0}, 2: {"pp": 1}, 3: {"pp": 1}}
        assert s["pipeline"]["heaviest_stage"] == 1, s["pipeline"]
        duty = DutyCycle(ranks[2]["pid"], stop=0.03, period=0.1)
        duty.start()
        flagged = wait_for(lambda: _stragglers(agent.status()), 120, 0.5, "the slowed rank flagged")
        assert [rank for rank, _ in flagged] == [2], flagged
    finally:
        if duty is not None:
            duty.end()
        _stop(job)
        agent.stop()
