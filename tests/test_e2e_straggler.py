"""Stragglers in real torchrun jobs: a rank slowed from inside (the harness's faults) or starved
of CPU from outside (pinned to a core with a busy process that outranks it), flagged with the
right cause."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import AgentProcess, parse_metrics, torchrun, wait_for
from rankwatch.agent.detect.work_scores import StragglerConfig

pytestmark = pytest.mark.e2e

ONSET = 80
# The harness's faults slow a rank by half its step time (own work x1.5 and more).  On this
# 2-core machine, noise alone has flagged ranks at x1.17-1.32 with the default threshold
# (8 %, BENCHMARKS.md), so the agent of the fault tests flags from x1.35 on: a false
# positive fails the test instead of being explained away.
FAULT_AGENT = ("--straggler-threshold", "0.35")


def straggler_incidents(agent, rank=None, since_step=0):
    """The straggler incidents (of ``rank``, if given) from ``since_step`` on."""
    return [i for i in agent.status()["incidents"]
            if i["kind"] == "straggler" and rank in (None, i["rank"]) and i["step"] >= since_step]


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
def test_slowed_rank_is_flagged_with_cause(tmp_path, fault, rank, cause):
    agent = AgentProcess(tmp_path / "agent.sock", extra=FAULT_AGENT).start()
    job = torchrun(2, "--steps", "1000", "--log-every", "0", "--fault", f"{fault}:{rank}:{ONSET}:0.5",
                   agent=agent.addr, log=tmp_path / "job.log")
    try:
        # The first straggler incident of the job, whichever rank it names.
        (inc, *_) = wait_for(lambda: straggler_incidents(agent), 120, interval=0.2, what="straggler incident")
        d = inc["detail"]
        # Within 40 steps of evidence, plus the detector's hold: a slowdown must last
        # ``hold_seconds`` of step time before it is flagged, so many more steps on a fast machine.
        held = math.ceil(StragglerConfig().hold_seconds / d["cost"]["step_seconds"])
        assert (inc["rank"], inc["node"]) == (rank, "n0") and ONSET <= inc["step"] <= ONSET + 40 + held, (inc, held)
        assert d["cause"] == cause and d["slowdown"] >= 1.3, d
        assert d["scope"] == "rank" and d["ranks"] == [rank]
        assert d["cost"]["speedup_if_removed"] > 1.05
        check_exported(agent, rank, cause)
        assert [i["rank"] for i in straggler_incidents(agent)] == [rank], "one flag, on the slowed rank"
    finally:
        stop(job, agent)
        agent.stop()


def _pin(pid: int, cpu: int, nice: int) -> None:
    """Pin every thread of ``pid`` to ``cpu`` at scheduling priority ``nice``.

    With autogroup scheduling (each session one group) a thread's nice only ranks it
    inside its session, so the session's group gets the nice value too.
    """
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), {cpu})
            os.setpriority(os.PRIO_PROCESS, int(tid), nice)
        except OSError:
            pass  # a thread that just exited
    try:
        with open(f"/proc/{pid}/autogroup", "w") as f:
            f.write(str(nice))
    except OSError:
        pass  # no autogroup scheduling: the thread priorities apply as they are


def test_rank_starved_of_cpu_is_a_host_straggler(agent_proc, tmp_path: Path):
    # From outside the job: rank 0 shares core 0 with a busy process that outranks it
    # (nice 15 against 0), rank 1 has core 1 at a high priority, whatever else runs here.
    if len(os.sched_getaffinity(0)) < 2 or os.geteuid() != 0:
        pytest.fail("this test needs 2 CPUs and root (to raise rank 1's priority)")
    job = torchrun(2, "--steps", "1000", "--log-every", "0", agent=agent_proc.addr, log=tmp_path / "job.log")
    hog = None
    try:
        def running() -> list[dict] | None:
            ranks = agent_proc.status()["ranks"]
            return ranks if len(ranks) == 2 and all(r["step"] >= 50 for r in ranks) else None

        ranks = wait_for(running, 120, what="both ranks past step 50")
        pids = {r["rank"]: r["pid"] for r in ranks}
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
        _pin(hog.pid, 0, 0)
        _pin(pids[0], 0, 15)
        _pin(pids[1], 1, -10)
        onset = max(r["step"] for r in agent_proc.status()["ranks"])
        (inc, *_) = wait_for(lambda: straggler_incidents(agent_proc, 0, onset), 90, interval=0.2,
                             what="straggler incident for the starved rank")
        assert inc["detail"]["cause"] == "host" and inc["detail"]["slowdown"] >= 1.2, \
            agent_proc.status()["incidents"]
        check_exported(agent_proc, 0, "host")
    finally:
        if hog is not None:
            hog.kill()
            hog.wait(10)
        stop(job, agent_proc)
