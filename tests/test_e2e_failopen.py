"""Fail-open: the agent is SIGKILLed mid-run; training goes on; a new agent picks up."""

from __future__ import annotations

import json
import re
import statistics
import time
from pathlib import Path

import pytest

from conftest import AgentProcess, torchrun, wait_for

pytestmark = pytest.mark.e2e


def logged_step(log: Path) -> int:
    """The last step the harness's rank 0 logged (``step N loss ...``), 0 before the first."""
    return max((int(m) for m in re.findall(r"\bstep (\d+) loss", log.read_text())), default=0)


def test_agent_killed_mid_run(tmp_path):
    agent = AgentProcess(tmp_path / "agent.sock").start()
    agent2 = AgentProcess(tmp_path / "agent.sock", log=tmp_path / "agent2.log")
    out = tmp_path / "out"
    job = torchrun(2, "--steps", "150", "--tp", "1", "--metrics-out", str(out), "--log-every", "1",
                   agent=agent.addr, log=tmp_path / "job.log")
    try:
        ranks = wait_for(lambda: (r := agent.status()["ranks"]) and len(r) == 2
                         and min(x["step"] for x in r) >= 15 and r, 90, what="job running")
        agent.kill()
        killed_at = time.monotonic()
        # Rank 0 logs every step: 10 more steps logged with no agent is training going on.
        last = max(r["step"] for r in ranks)
        wait_for(lambda: logged_step(tmp_path / "job.log") >= last + 10, 60,
                 what="steps trained without the agent")
        assert job.poll() is None, "training died with the agent"
        agent2.start()
        restarted = time.monotonic()

        def resumed():
            ranks = agent2.status()["ranks"]
            return len(ranks) == 2 and all(r["connected"] and r["step"] > 0 for r in ranks) and ranks

        ranks = wait_for(resumed, 5, interval=0.05, what="metrics to resume on the new agent")
        resumed_after = time.monotonic() - restarted
        # Records sent to the dead agent in its last moments are reported as dropped.
        assert sum(r["dropped"] for r in ranks) > 0
        assert job.wait(180) == 0, (tmp_path / "job.log").read_text()[-2000:]
        final = agent2.status()["ranks"]
        assert all(r["step"] == 150 for r in final)
        metrics = agent2.metrics()
        assert "rankwatch_rank_dropped_records_total" in metrics
    finally:
        if job.poll() is None:
            job.kill()
        agent.stop()
        agent2.stop()
    rank0 = json.loads((out / "rank0.json").read_text())
    assert len(rank0["step_times"]) == 150
    print(f"resumed {resumed_after:.2f}s after restart; outage {restarted - killed_at:.1f}s; "
          f"median step {statistics.median(rank0['step_times']) * 1e3:.1f} ms")
