"""``rankwatch analyze NEW --compare BASE [--fail-over PCT]``: two runs' step time, per phase,
stage and op, over traces in the documented format (tests/tracegen.py), read by the readers the
command uses and, end to end, through the command itself."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import AgentProcess
from rankwatch.agent.analyze.compare import compare, compare_main, regressed, text
from rankwatch.agent.analyze.readers import read_paths
from tracegen import Job, write

# 32 ranks: 8 replicas x 4 stages, microbatches and P2P between the stages.
SHAPE = dict(dp=8, pp=4, steps=40)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("runs")
    return {
        "base": write(Job(**SHAPE, seed=1), str(d / "base.jsonl.gz")),
        "clean": write(Job(**SHAPE, seed=2), str(d / "clean.parquet")),
        # replica 2's loader (rank 8, a first stage) takes 20 ms more a step
        "slow_loader": write(Job(**SHAPE, seed=3, slow_loader=8, loader_extra=0.02), str(d / "slow.csv")),
    }


def test_a_slowed_loader_is_named_the_data_phase(runs):
    cmp = compare(read_paths([runs["slow_loader"]]), read_paths([runs["base"]]))
    assert regressed(cmp, 10) and cmp["step"]["change_pct"] > 10
    assert [r["phase"] for r in cmp["phases"]][0] == "data"
    assert cmp["worst"]["kind"] == "phase" and cmp["worst"]["what"] == "data"
    data = cmp["phases"][0]
    assert data["change_s"] == pytest.approx(0.02, rel=0.15) and data["change_pct"] > 300
    # the typical rank's data time (median over rank-steps) hides one slow loader of eight
    assert abs(data["all_ranks"]["change_pct"]) < 5
    # its peers waited as long, but the waits on the step-setting rank barely moved
    assert all(abs(r["change_s"]) < 0.004 for r in cmp["phases"][1:])
    assert cmp["stages"][0]["stage"] == 0 and cmp["ops"][0]["op"] == "dataloader_next"
    shown = text(cmp)
    assert "data" in shown.splitlines()[5] and "+20.0 ms a step" in shown
    assert "largest: data +" in shown


def test_two_clean_runs_are_not_a_regression(runs):
    cmp = compare(read_paths([runs["clean"]]), read_paths([runs["base"]]))
    assert not regressed(cmp, 10) and abs(cmp["step"]["change_pct"]) < 2
    assert {r["phase"] for r in cmp["phases"]} == {"data", "compute", "p2p", "collective", "optimizer"}
    assert all(abs(r["change_pct"]) < 10 for r in cmp["phases"])
    assert len(cmp["stages"]) == 4 and 0 < len(cmp["ops"]) <= 20


def test_the_command_body_exits_by_the_threshold(runs):
    out = io.StringIO()
    assert compare_main([runs["slow_loader"]], [runs["base"]], 10.0, True, out) == 1
    got = json.loads(out.getvalue())
    assert got["regressed"] is True and got["worst"]["what"] == "data"
    assert compare_main([runs["slow_loader"]], [runs["base"]], 50.0, False, io.StringIO()) == 0
    assert compare_main([runs["clean"]], [runs["base"]], 10.0, False, io.StringIO()) == 0
    assert compare_main([runs["clean"]], [runs["base"]], None, False, io.StringIO()) == 0


def test_a_broken_run_exits_2_naming_the_file_row_and_field(runs, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"rank": 0, "step": 1, "op": "f", "kind": "compute", "start": 0, "duration": 0.1}\n'
                   '{"rank": 0, "step": 2, "op": "f", "kind": "compute", "start": 0, "duration": -1}\n')
    assert compare_main([str(bad)], [runs["base"]], 10.0, False, io.StringIO()) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:2" in err and "duration" in err


@pytest.mark.e2e
def test_the_cli_fails_a_ci_build_on_a_slowed_loader(runs):
    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "rankwatch.agent.cli", "analyze", *args],
                              capture_output=True, text=True, timeout=120)
    slow = cli(runs["slow_loader"], "--compare", runs["base"], "--fail-over", "10")
    assert slow.returncode == 1, slow.stderr
    assert "largest: data" in slow.stdout and "REGRESSED" in slow.stdout
    clean = cli(runs["clean"], "--compare", runs["base"], "--fail-over", "10", "--json")
    assert clean.returncode == 0, clean.stderr
    assert json.loads(clean.stdout)["regressed"] is False


def _recorded(tmp_path: Path, *faults: str) -> Path:
    """A real harness job of 2 ranks under ``rankwatch run`` with ``faults``, watched by a real
    agent; its state directory once the agent has stopped (its history written out)."""
    tmp_path.mkdir()
    agent = AgentProcess(tmp_path / "agent.sock").start()
    fault_args = [a for f in faults for a in ("--fault", f)]
    try:
        job = subprocess.run(
            [sys.executable, "-m", "rankwatch.agent.cli", "run", "--agent", str(agent.addr), "--",
             "--standalone", "--nproc-per-node", "2", "-m", "rankwatch.hooks.train", "--steps", "150",
             "--log-every", "0", *fault_args],
            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=open(tmp_path / "job.log", "w"),
            stderr=subprocess.STDOUT, timeout=300)
        assert job.returncode == 0, (tmp_path / "job.log").read_text()[-3000:]
    finally:
        agent.stop()   # SIGTERM: the agent writes out what its history holds
    return tmp_path / "state-n0"


@pytest.mark.e2e
def test_two_real_runs_a_slowed_loader_fails_the_build(tmp_path):
    base = _recorded(tmp_path / "base")
    # rank 0's data loading takes its usual step time longer from step 0 on
    new = _recorded(tmp_path / "new", "slow_data:0:0:1.0")
    out = subprocess.run([sys.executable, "-m", "rankwatch.agent.cli", "analyze", str(new), "--compare", str(base),
                          "--fail-over", "10", "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    cmp = json.loads(out.stdout)
    assert cmp["regressed"] and cmp["step"]["change_pct"] > 10
    assert cmp["worst"]["what"] == "data" and cmp["phases"][0]["phase"] == "data", cmp["phases"]
