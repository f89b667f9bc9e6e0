"""Pipeline and expert parallelism watched as rightly as data parallelism, on real torchrun jobs.

* Three layouts: a head-heavy two-stage pipeline (``--pp 2 --dp 2``, stage 1 holds three
  times stage 0's layers and the loss head), pipeline and experts (``--pp 2 --ep 2``), and
  experts alone (``--ep 2``).  160 clean steps each: no straggler, and the stage imbalance
  named with the ratio the stages' own work shows.  Then, with stages, one rank is slowed
  from outside (a SIGSTOP duty cycle): it is flagged, against its own stage, and no other
  rank.  Experts alone are not slowed: LAYOUTS says why.
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

    def end(self) -> None:
        """Stop cycling and leave the process running (it is SIGCONTed last)."""
        self.done.set()
        self.join(5)

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


# name: (ranks, harness flags, the victim's mesh coordinates).  With stages, the victim is in
# the heavy stage 1: there a duty cycle's stops land in its own work, and a detector that
# compared across stages would flag its stage-1 peer too.  (Stage 0 idles about 80 % of its
# step in its receives, which absorb most stops: its own work grew 4 % under this cycle, and
# the rank was flagged only now and then.)  With experts, it is stage 1's colder expert rank.
# The router sends its peer (ep 1) more tokens: 1.3x in one run, over the 1.5x hot-expert
# line in another. Slowed, that peer may be named expert_load, which is not what this
# checks.
LAYOUTS = {
    "pp2_dp2": (4, ("--pp", "2", "--dp", "2", "--layers", "4", "--pp-split", "1,3"), {"pp": 1, "dp": 0, "tp": 0}),
    "pp2_ep2": (4, ("--pp", "2", "--ep", "2", "--layers", "4", "--pp-split", "1,3"), {"pp": 1, "dp": 0, "tp": 0, "ep": 0}),
    # Experts alone: clean steps only.  On two expert-parallel ranks (an all-to-all per layer
    # each way) most of a duty cycle's stops land in the all-to-all waits, where both ranks are
    # blocked alike: the victim's own work grows 5-10 % under 30 % stopped.  Its late arrival
    # at the next collectives shows part of it: flagged within 60 s in 2 to 5 of 5 runs
    # (benchmarks/ep_sigstop.py; own work alone: 0 of 2 within 90 s).  Not yet reliable
    # enough to check here.
    "ep2": (2, ("--ep", "2", "--experts", "4"), None),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_clean_steps_flag_nothing_and_a_rank_slowed_from_outside_is_flagged_alone(tmp_path, layout):
    """160 clean steps: no straggler (pipeline stages differ by design; experts' loads vary),
    and where there are stages their imbalance is named with the ratio their own work shows.
    Then, with stages, one rank is slowed from outside (a SIGSTOP duty cycle): it is flagged,
    against the ranks of its own stage, and no other rank is (experts alone: see LAYOUTS)."""
    nproc, flags, victim_mesh = LAYOUTS[layout]
    agent = AgentProcess(tmp_path / "agent.sock").start()
    job = torchrun(nproc, *flags, "--steps", "100000", agent=agent.addr, log=tmp_path / "job.log")
    duty = None
    try:
        def clean_steps():
            s = agent.status()
            ranks = s["ranks"]
            return s if len(ranks) == nproc and min(r["step"] for r in ranks) >= 160 else None

        s = wait_for(clean_steps, 400, 1.0, "160 clean steps")
        assert _stragglers(s) == [], "ranks that differ by design were called stragglers"
        assert {r["state"] for r in s["ranks"]} == {"ok"}
        if "--pp" in flags:
            _check_stage_imbalance(agent, s)
        else:
            assert s["pipeline"] is None

        if victim_mesh is None:
            return
        victim = next(r for r in s["ranks"] if victim_mesh.items() <= r["mesh"].items())
        duty = DutyCycle(victim["pid"], stop=0.03, period=0.1)
        duty.start()
        flagged = wait_for(lambda: _stragglers(agent.status()), 120, 0.5, "the slowed rank flagged")
        assert [rank for rank, _ in flagged] == [victim["rank"]], flagged
        assert flagged[0][1] != "expert_load", flagged   # its experts got no more tokens
    finally:
        if duty is not None:
            duty.end()
        _stop(job)
        agent.stop()


def _check_stage_imbalance(agent: AgentProcess, s: dict) -> None:
    """Stage 1 (the loss head, and more layers) is the heavier, by the ratio its own work shows."""
    pipe = s["pipeline"]
    assert (pipe["heaviest_stage"], pipe["lightest_stage"], pipe["scope"]) == (1, 0, "node"), pipe
    # The ranks' own-work medians (over a longer window) give the same ratio.
    own = {stage: statistics.median(r["own_work_seconds"] for r in s["ranks"] if r["mesh"]["pp"] == stage)
           for stage in (0, 1)}
    assert pipe["imbalance"] > 1.2 and pipe["imbalance"] == pytest.approx(own[1] / own[0], rel=0.3), (pipe, own)
    assert pipe["text"].startswith(f"stage 1 works {pipe['imbalance']:.1f}x stage 0")
    bubbles = {st["stage"]: st["bubble"] for st in pipe["stages"]}
    assert bubbles[0] > bubbles[1], pipe   # the light stage idles in its receives
    m = parse_metrics(agent.metrics())
    assert m[("rankwatch_pipeline_stage_imbalance_ratio", frozenset({("node", "n0"), ("scope", "node")}))] > 1.2


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
