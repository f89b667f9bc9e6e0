"""Pipeline and expert parallelism watched as rightly as data parallelism, on real torchrun jobs.

* A head-heavy two-stage pipeline (``--pp 2 --dp 2``, stage 1 holds three times stage 0's
  layers and the loss head), 300 clean steps: no straggler, and the stage imbalance named
  with the ratio the stages' own work shows.  Then one rank of stage 0 is slowed from
  outside (a SIGSTOP duty cycle): it is flagged, against its own stage, and no other rank.
* A mixture of experts (``--ep 2``) whose router favours one expert: the rank that holds it
  is a straggler of cause ``expert_load``, and the experts' skew is in ``status``.
"""

from __future__ import annotations

import os
import signal
import statistics
import threading

import pytest

from conftest import AgentProcess, parse_metrics, torchrun, wait_for

pytestmark = pytest.mark.e2e


class DutyCycle(threading.Thread):
    """SIGSTOP a process for ``stop`` seconds out of every ``period`` (a fault from outside)."""

    def __init__(self, pid: int, stop: float, period: float) -> None:
        super().__init__(daemon=True)
        self.pid, self.stop_s, self.period = pid, stop, period
        self.done = threading.Event()

    def run(self) -> None:
        try:
            while not self.done.is_set():
                os.kill(self.pid, signal.SIGSTOP)
                self.done.wait(self.stop_s)
                os.kill(self.pid, signal.SIGCONT)
                self.done.wait(self.period - self.stop_s)
        except ProcessLookupError:
            return
        finally:
            try:
                os.kill(self.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


def _stop(job) -> None:
    if job.poll() is None:
        os.killpg(job.pid, signal.SIGTERM)
        try:
            job.wait(30)
        except Exception:  # noqa: BLE001 - a wedged job is killed
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(10)


def _stragglers(status: dict) -> list[tuple[int, str]]:
    return [(i["rank"], i["detail"]["cause"]) for i in status["incidents"] if i["kind"] == "straggler"]


def test_a_head_heavy_pipeline_is_uneven_by_design_and_a_slowed_rank_is_flagged_within_its_stage(tmp_path):
    agent = AgentProcess(tmp_path / "agent.sock").start()
    job = torchrun(4, "--pp", "2", "--dp", "2", "--layers", "4", "--pp-split", "1,3", "--steps", "100000",
                   agent=agent.addr, log=tmp_path / "job.log")
    duty = None
    try:
        def clean_steps():
            s = agent.status()
            ranks = s["ranks"]
            return s if len(ranks) == 4 and min(r["step"] for r in ranks) >= 300 and s["pipeline"] else None

        s = wait_for(clean_steps, 400, 1.0, "300 clean pipeline steps")
        assert _stragglers(s) == [], "stages that differ by design were called stragglers"
        assert {r["state"] for r in s["ranks"]} == {"ok"}
        pipe = s["pipeline"]
        assert (pipe["heaviest_stage"], pipe["lightest_stage"], pipe["scope"]) == (1, 0, "node")
        # The ratio is the one the stages' own work shows (the ranks' medians, over a longer window).
        own = {stage: statistics.median(r["own_work_seconds"] for r in s["ranks"] if r["mesh"]["pp"] == stage)
               for stage in (0, 1)}
        assert pipe["imbalance"] > 1.5 and pipe["imbalance"] == pytest.approx(own[1] / own[0], rel=0.3), (pipe, own)
        assert pipe["text"].startswith(f"stage 1 works {pipe['imbalance']:.1f}x stage 0")
        bubbles = {st["stage"]: st["bubble"] for st in pipe["stages"]}
        assert bubbles[0] > bubbles[1], pipe   # the light stage idles in its receives
        m = parse_metrics(agent.metrics())
        assert m[("rankwatch_pipeline_stage_imbalance_ratio", frozenset({("node", "n0"), ("scope", "node")}))] > 1.5

        # One rank of stage 0 slowed from outside: compared with stage 0's other rank only.
        victim = next(r for r in s["ranks"] if r["mesh"] == {"pp": 0, "dp": 0, "tp": 0})
        duty = DutyCycle(victim["pid"], stop=0.03, period=0.1)
        duty.start()
        flagged = wait_for(lambda: _stragglers(agent.status()), 120, 0.5, "the slowed rank flagged")
        assert [rank for rank, _ in flagged] == [victim["rank"]], flagged
    finally:
        if duty is not None:
            duty.done.set()
            duty.join(5)
        _stop(job)
        agent.stop()


def test_the_rank_holding_a_hot_expert_is_an_expert_load_straggler(tmp_path):
    agent = AgentProcess(tmp_path / "agent.sock").start()
    # Expert 0 (on rank 0: experts 0-1 of 4) takes nearly every token.
    job = torchrun(2, "--ep", "2", "--experts", "4", "--hidden-dim", "512", "--router-bias", "0:8",
                   "--steps", "100000", agent=agent.addr, log=tmp_path / "job.log")
    try:
        flagged = wait_for(lambda: _stragglers(agent.status()), 240, 0.5, "the hot rank flagged")
        assert flagged == [(0, "expert_load")], flagged
        experts = agent.status()["experts"]
        assert experts["hottest_rank"] == 0 and experts["skew"] > 1.5, experts
        assert experts["tokens_per_step"]["0"] > 3 * experts["tokens_per_step"]["1"], experts
    finally:
        _stop(job)
        agent.stop()
