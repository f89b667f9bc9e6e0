"""Stragglers in real torchrun jobs: a rank slowed from inside (the harness's faults) or starved
of CPU from outside (pinned to one core with a busy process), flagged with the right cause."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import parse_metrics, torchrun, wait_for

pytestmark = pytest.mark.e2e

ONSET = 80


def straggler_incidents(agent, rank):
    return [i for i in agent.status()["incidents"] if i["kind"] == "straggler" and i["rank"] == rank]


def check_exported(agent, rank: int, cause: str) -> None:
    states = {r["rank"]: r["state"] for r in agent.status()["ranks"]}
    assert states[rank] == "straggler", states
    metrics = parse_metrics(agent.metrics())
    flag = ("rankwatch_rank_straggler", frozenset({("node", "n0"), ("rank", str(rank)), ("cause", cause)}))
    assert metrics.get(flag) == 1.0, [k for k in metrics if k[0] == "rankwatch_rank_straggler"]
    assert metrics[("rankwatch_straggler_cost_ratio", frozenset({("node", "n0")}))] > 1.05
    assert ("rankwatch_rank_straggler_slowdown_ratio", frozenset({("node", "n0"), ("rank", str(rank))})) in metrics


def stop(job: subprocess.Popen, agent) -> None:
    """Kill torchrun and its workers (each worker runs in a session of its own)."""
    workers = [r["pid"] for r in agent.status()["ranks"]]
    if job.poll() is None:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait(30)
    for pid in workers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("fault,rank,cause", [("slow_compute", 1, "compute"), ("slow_data", 0, "data")])
def test_slowed_rank_is_flagged_with_cause(agent_proc, tmp_path, fault, rank, cause):
    job = torchrun(2, "--steps", "1000", "--log-every", "0", "--fault", f"{fault}:{rank}:{ONSET}:0.5",
                   agent=agent_proc.addr, log=tmp_path / "job.log")
    try:
        (inc, *_) = wait_for(lambda: straggler_incidents(agent_proc, rank), 120, interval=0.2,
                             what="straggler incident")
        d = inc["detail"]
        assert inc["node"] == "n0" and d["cause"] == cause and d["slowdown"] >= 1.2, inc
        assert d["scope"] == "rank" and d["ranks"] == [rank]
        assert d["cost"]["speedup_if_removed"] > 1.05
        assert ONSET <= inc["step"] <= ONSET + 40, inc["step"]
        check_exported(agent_proc, rank, cause)
    finally:
        stop(job, agent_proc)


def _pin(pid: int, cpu: int) -> None:
    """Pin every thread of ``pid`` to ``cpu``."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), {cpu})
        except OSError:
            pass  # a thread that just exited


def test_rank_starved_of_cpu_is_a_host_straggler(agent_proc, tmp_path: Path):
    # From outside the job: rank 0 shares core 0 with a busy process, rank 1 has core 1.
    if len(os.sched_getaffinity(0)) < 2:
        pytest.fail("this test needs 2 CPUs to pin the ranks apart")
    job = torchrun(2, "--steps", "1000", "--log-every", "0", agent=agent_proc.addr, log=tmp_path / "job.log")
    hog = None
    try:
        ranks = wait_for(lambda: [r for r in agent_proc.status()["ranks"] if r["step"] >= 50], 120,
                         what="both ranks past step 50")
        pids = {r["rank"]: r["pid"] for r in agent_proc.status()["ranks"]}
        assert len(ranks) == 2, ranks
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        _pin(hog.pid, 0)
        _pin(pids[0], 0)
        _pin(pids[1], 1)
        (inc, *_) = wait_for(lambda: straggler_incidents(agent_proc, 0), 90, interval=0.2,
                             what="straggler incident for the starved rank")
        assert inc["detail"]["cause"] == "host" and inc["detail"]["slowdown"] >= 1.2, inc
        assert not straggler_incidents(agent_proc, 1)
        check_exported(agent_proc, 0, "host")
    finally:
        if hog is not None:
            hog.kill()
            hog.wait(10)
        stop(job, agent_proc)
