"""A real 4-rank torchrun job (dp2 x tp2, FSDP2 + TP on gloo) against a real agent."""

from __future__ import annotations

import collections
import json
import statistics
import subprocess
import sys

import pytest

from conftest import parse_metrics, torchrun

pytestmark = pytest.mark.e2e

STEPS = 12
# Each rank's share of a step's tokens as the harness reports it: --batch-size 4 samples of
# --seq-len 32 (its defaults) per dp rank, split over the tp 2 ranks that share them.
TOKENS_PER_RANK_STEP = 4 * 32 / 2
# gloo implements reduce_scatter with an all_reduce, and its Flight Recorder
# names the entry after that; every other op keeps its name.
GLOO_FR_NAME = {"reduce_scatter": "all_reduce"}


def run_job(tmp_path, name, *extra, agent=None):
    out = tmp_path / name
    job = torchrun(4, "--steps", str(STEPS), "--dp", "2", "--tp", "2", "--metrics-out", str(out),
                   *extra, agent=agent, log=tmp_path / f"{name}.log")
    rc = job.wait(240)
    assert rc == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(4)}


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """One instrumented job, and the same job without rankwatch, for comparison."""
    from conftest import AgentProcess

    tmp = tmp_path_factory.mktemp("job")
    agent = AgentProcess(tmp / "agent.sock").start()
    try:
        ranks = run_job(tmp, "on", agent=agent.addr)
        status = json.loads(subprocess.run(
            [sys.executable, "-m", "rankwatch.agent.cli", "status", "--agent", str(agent.addr), "--json"],
            capture_output=True, text=True, check=True).stdout)
        metrics = parse_metrics(agent.metrics())
    finally:
        agent.stop()
    bare = run_job(tmp, "off", "--no-rankwatch")
    return ranks, status, metrics, bare


def test_status_shows_every_rank(job):
    ranks, status, _, _ = job
    by_rank = {r["rank"]: r for r in status["ranks"]}
    assert sorted(by_rank) == [0, 1, 2, 3]
    for r, rec in ranks.items():
        row = by_rank[r]
        assert row["pid"] == rec["pid"] and row["node"] == "n0"
        assert row["step"] == STEPS and row["state"] == "ok" and row["step_seconds"] > 0
        assert row["mesh"] == {"dp": r // 2, "tp": r % 2}
    assert status["incidents"] == []


def test_phases_add_up_to_step_time(job):
    ranks, status, _, _ = job
    for row in status["ranks"]:
        ph = row["phase_seconds"]
        marked = ph["data"] + ph["forward"] + ph["backward"] + ph["optimizer"]
        # Medians over the agent's recent steps: marked phases cover almost all of them,
        # and they add up to the step time of the same steps.
        total = marked + ph["other"]
        assert 0.9 <= marked / total <= 1.0, ph
        assert total == pytest.approx(row["step_seconds"], rel=0.25), (ph, row["step_seconds"])
        # Independently, the harness's own clock around the step.
        own = statistics.median(ranks[row["rank"]]["step_times"][2:])
        assert 0.6 <= row["step_seconds"] / own <= 1.4, (row["step_seconds"], own)


def test_metrics_show_every_rank(job):
    ranks, _, metrics, _ = job
    for r in range(4):
        assert metrics[("rankwatch_rank_step", frozenset({("node", "n0"), ("rank", str(r))}))] == STEPS
    assert metrics[("rankwatch_step_duration_seconds_count", frozenset({("node", "n0")}))] == 4 * STEPS
    assert metrics[("rankwatch_steps_total", frozenset({("node", "n0")}))] == 4 * STEPS
    # Tokens/s from the job's own numbers: each rank's tokens per step over its mean step
    # time by the harness's clock (the agent's window holds all 12 steps).
    want = {r: TOKENS_PER_RANK_STEP / statistics.mean(rec["step_times"]) for r, rec in ranks.items()}
    node = metrics[("rankwatch_tokens_per_second", frozenset({("node", "n0")}))]
    assert node == pytest.approx(sum(want.values()), rel=0.15), (node, want)
    for r in range(4):
        share = metrics[("rankwatch_rank_tokens_per_second", frozenset({("node", "n0"), ("rank", str(r))}))]
        assert share == pytest.approx(want[r], rel=0.15), (r, share, want[r])
    assert metrics[("rankwatch_tokens_total", frozenset({("node", "n0")}))] == 4 * STEPS * TOKENS_PER_RANK_STEP
    ops = {dict(k[1])["op"] for k in metrics if k[0] == "rankwatch_collective_duration_seconds_count"}
    assert {"all_gather", "reduce_scatter", "all_reduce"} <= ops


def test_collective_counts_match_flight_recorder(job):
    """Per rank and op, what the agent counted equals what the job issued.

    The independent count is PyTorch's Flight Recorder, dumped by each rank.
    """
    ranks, _, metrics, _ = job
    for r, rec in ranks.items():
        issued = collections.Counter(e["profiling_name"].split(":", 1)[1] for e in rec["flight_recorder"])
        assert issued, "Flight Recorder recorded nothing"
        counted = collections.Counter()
        for (name, labels), value in metrics.items():
            lab = dict(labels)
            if name == "rankwatch_rank_collectives_total" and lab["rank"] == str(r):
                counted[GLOO_FR_NAME.get(lab["op"], lab["op"])] += int(value)
        assert counted == issued, (r, counted, issued)


def test_equal_loss_with_and_without_rankwatch(job):
    ranks, _, _, bare = job
    for r in range(4):
        assert ranks[r]["losses"] == bare[r]["losses"]
