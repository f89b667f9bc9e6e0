"""A user's own training script (tests/data/user_fsdp.py) under ``rankwatch run``, as the README says.

Not the harness: its own model, ``init_device_mesh``, ``fully_shard`` (and a TP
variant), its own DataLoader, and only the README's instrumentation.  Every
rank must be in ``status``, with the right backend and mesh, and the agent must
have per-op latency and the reduce-scatter's bytes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import parse_metrics, wait_for

pytestmark = pytest.mark.e2e

SCRIPT = Path(__file__).parent / "data" / "user_fsdp.py"
STEPS = 40


def _run(agent, tmp_path: Path, *script_args: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "rankwatch.agent.cli", "run", "--agent", str(agent.addr), "--node-id", "n0",
         "--", "--standalone", "--nproc-per-node", "2", str(SCRIPT), "--steps", str(STEPS), *script_args],
        capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


def _per_op(metrics: dict, name: str) -> dict[str, float]:
    return {dict(labels)["op"]: v for (n, labels), v in metrics.items() if n == name}


def test_a_users_fsdp2_script(agent_proc, tmp_path):
    _run(agent_proc, tmp_path)
    status = agent_proc.status()
    ranks = sorted(status["ranks"], key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["backend"] == "gloo" and r["collective_source"] == "python_wrappers"
        assert r["mesh"] == {"dp": r["rank"]} and r["step"] == STEPS
        # rw.init() stood zero-code instrumentation down: the script's markers alone, counted once.
        assert r["instrumentation"] == "explicit"
        assert r["phase_seconds"]["data"] > 0 and r["phase_seconds"]["forward"] > 0
        # Per-op latency per rank: every call counted, quantiles over the recent ones.
        for op in ("all_gather", "reduce_scatter"):
            lat = r["op_latency"][op]
            assert lat["count"] >= STEPS and 0 < lat["p50_seconds"] <= lat["p99_seconds"], (op, lat)
    table = subprocess.run([sys.executable, "-m", "rankwatch.agent.cli", "status", "--agent", str(agent_proc.addr)],
                           capture_output=True, text=True, timeout=60)
    assert "collective latency per rank" in table.stdout and "reduce_scatter" in table.stdout, table.stdout
    m = parse_metrics(agent_proc.metrics())
    counts = _per_op(m, "rankwatch_collective_duration_seconds_count")
    nbytes = _per_op(m, "rankwatch_collective_bytes_total")
    # FSDP2, the model one unit (the root keeps its parameters between forward and backward):
    # an all-gather and a reduce-scatter per step on each of the node's 2 ranks.
    assert counts["all_gather"] >= 2 * STEPS and counts["reduce_scatter"] >= 2 * STEPS
    assert nbytes["reduce_scatter"] > 0 and nbytes["all_gather"] > 0


def test_a_users_tp_script(agent_proc, tmp_path):
    _run(agent_proc, tmp_path, "--tp", "2")
    status = agent_proc.status()
    ranks = sorted(status["ranks"], key=lambda r: r["rank"])
    assert [r["mesh"] for r in ranks] == [{"dp": 0, "tp": 0}, {"dp": 0, "tp": 1}]
    assert all(r["backend"] == "gloo" and r["step"] == STEPS for r in ranks)
    counts = _per_op(parse_metrics(agent_proc.metrics()), "rankwatch_collective_duration_seconds_count")
    # RowwiseParallel's output all-reduce (a functional collective) in every forward, on both ranks.
    assert counts["all_reduce"] >= 2 * STEPS


def test_a_users_pipeline_script(agent_proc, tmp_path):
    """tests/data/user_pipeline.py: its own stage split with ``torch.distributed.pipelining``
    (GPipe, 4 microbatches), its stage 1 three times stage 0's blocks and the head.  Each rank
    reports its stage, its sends and receives are timed, and while it trains the agent names
    the stages' imbalance (stage 1 the heavier), not a straggler."""
    script = Path(__file__).parent / "data" / "user_pipeline.py"
    job = subprocess.Popen(
        [sys.executable, "-m", "rankwatch.agent.cli", "run", "--agent", str(agent_proc.addr), "--node-id", "n0",
         "--", "--standalone", "--nproc-per-node", "2", str(script), "--steps", "300"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        def balanced():
            s = agent_proc.status()
            return s if s["pipeline"] and min((r["step"] for r in s["ranks"]), default=0) >= 60 else None

        status = wait_for(balanced, 180, 0.5, "the pipeline's balance while it trains")
        out, _ = job.communicate(timeout=240)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode == 0, out[-3000:]
    pipe = status["pipeline"]
    assert (pipe["heaviest_stage"], pipe["lightest_stage"]) == (1, 0) and pipe["imbalance"] > 1.1, pipe
    ranks = sorted(agent_proc.status()["ranks"], key=lambda r: r["rank"])
    assert [(r["mesh"], r["step"], r["instrumentation"]) for r in ranks] == [
        ({"pp": 0}, 300, "explicit"), ({"pp": 1}, 300, "explicit")]
    for r in ranks:   # GPipe: each microbatch's activation forward, its gradient back
        assert r["op_latency"]["send"]["count"] >= 300 * 4 and r["op_latency"]["recv"]["count"] >= 300 * 4, r
    assert [i for i in agent_proc.status()["incidents"] if i["kind"] == "straggler"] == []
