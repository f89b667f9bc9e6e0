"""Stragglers in real torchrun jobs: a rank's forward or data loading is slowed from a given step."""

from __future__ import annotations

import os
import signal

import pytest

from conftest import torchrun, wait_for

pytestmark = pytest.mark.e2e

ONSET = 80


def straggler_incidents(agent, rank):
    return [i for i in agent.status()["incidents"] if i["kind"] == "straggler" and i["rank"] == rank]


@pytest.mark.parametrize("fault,rank,cause", [("slow_compute", 1, "compute"), ("slow_data", 0, "data")])
def test_slowed_rank_is_flagged_with_cause(agent_proc, tmp_path, fault, rank, cause):
    job = torchrun(2, "--steps", "1000", "--log-every", "0", "--fault", f"{fault}:{rank}:{ONSET}:0.5",
                   agent=agent_proc.addr, log=tmp_path / "job.log")
    try:
        (inc, *_) = wait_for(lambda: straggler_incidents(agent_proc, rank), 120, interval=0.2,
                             what="straggler incident")
        d = inc["detail"]
        assert inc["node"] == "n0" and d["cause"] == cause and d["slowdown"] >= 1.2, inc
        assert d["cost"]["speedup_if_removed"] > 1.05
        assert inc["step"] >= ONSET and inc["step"] - ONSET <= 120, inc["step"]
        states = {r["rank"]: r["state"] for r in agent_proc.status()["ranks"]}
        assert states[rank] == "straggler"
        metrics = agent_proc.metrics()
        assert f'rankwatch_rank_straggler_slowdown_ratio{{node="n0",rank="{rank}"}}' in metrics
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(30)
