"""Unmodified scripts under ``rankwatch run``: watched with no code change (zero-code
instrumentation), their steps counted as the scripts count them.

The scripts in tests/data/plain_*.py never import rankwatch.  Faults come from outside
(SIGSTOP) or from the scripts' own arguments (a slow loader), as a user's would.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import parse_metrics, wait_for

pytestmark = pytest.mark.e2e

DATA = Path(__file__).parent / "data"


def _run_cmd(agent, script: str, *args: str, nproc: int = 2) -> list[str]:
    target = ["-m", script] if not script.endswith(".py") else [str(DATA / script)]
    return [sys.executable, "-m", "rankwatch.agent.cli", "run", "--agent", str(agent.addr), "--node-id", "n0",
            "--", "--standalone", "--nproc-per-node", str(nproc), *target, *args]


def _run(agent, script: str, *args: str, env: dict | None = None) -> None:
    """Run ``script`` (a file in tests/data, or a module name: ``-m`` from tests/data) to its end."""
    out = subprocess.run(_run_cmd(agent, script, *args), capture_output=True, text=True, timeout=240, cwd=DATA,
                         env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "zero-code instrumentation" not in out.stderr, out.stderr[-3000:]


def _counts(prefix: Path, n: int) -> list[int]:
    return [int(Path(f"{prefix}.{r}").read_text()) for r in range(n)]


def _ranks(agent) -> list[dict]:
    return sorted(agent.status()["ranks"], key=lambda r: r["rank"])


def test_an_unmodified_ddp_script_with_accumulation_and_eval(agent_proc, tmp_path):
    """Two micro-batches per update and an eval pass every 5 updates: the agent's step count
    is the script's own, and DDP's bucket all-reduces (issued from C++) are timed.  Run as
    ``-m plain_ddp``: the bootstrap runs before a module as before a script."""
    _run(agent_proc, "plain_ddp", "--epochs", "2", "--accumulate", "2", "--eval-every", "5",
         "--count-out", str(tmp_path / "count"))
    counts = _counts(tmp_path / "count", 2)
    assert counts == [16, 16]   # 256 samples / 2 ranks / 8 a batch / 2 micro-batches, twice
    ranks = _ranks(agent_proc)
    assert [r["rank"] for r in ranks] == [0, 1]
    for r, count in zip(ranks, counts):
        assert r["instrumentation"] == "auto" and r["backend"] == "gloo"
        assert r["step"] == count and r["state"] == "ok"
        assert r["phase_seconds"]["data"] > 0 and r["phase_seconds"]["backward"] > 0
        lat = r["op_latency"]["all_reduce"]
        assert lat["count"] >= 2 * count and 0 < lat["p50_seconds"] <= lat["p99_seconds"], lat
    m = parse_metrics(agent_proc.metrics())
    nbytes = {dict(k[1])["op"]: v for k, v in m.items() if k[0] == "rankwatch_collective_bytes_total"}
    assert nbytes["all_reduce"] > 0


def test_an_unmodified_fsdp2_script_with_two_optimizers_and_a_tp_mesh(agent_proc, tmp_path):
    """``init_device_mesh`` makes the process group: the mesh's coordinates reach the agent, and
    two optimizers stepped after each backward count one step."""
    _run(agent_proc, "plain_fsdp.py", "--steps", "20", "--tp", "2", "--count-out", str(tmp_path / "count"))
    assert _counts(tmp_path / "count", 2) == [20, 20]
    ranks = _ranks(agent_proc)
    assert [r["mesh"] for r in ranks] == [{"dp": 0, "tp": 0}, {"dp": 0, "tp": 1}]
    for r in ranks:
        assert r["instrumentation"] == "auto" and r["step"] == 20
        assert r["op_latency"]["all_reduce"]["count"] >= 20   # the TP row-wise output's


def test_auto_off_leaves_an_unmodified_script_alone(agent_proc, tmp_path):
    _run(agent_proc, "plain_ddp.py", "--count-out", str(tmp_path / "count"), env={"RANKWATCH_AUTO": "0"})
    assert _counts(tmp_path / "count", 2) == [16, 16]
    assert agent_proc.status()["ranks"] == []


def test_a_slow_loader_is_a_data_straggler_and_then_a_sigstopped_worker_is_named(agent_proc, tmp_path):
    """One job, two faults from outside the unmodified script: rank 1's loader is slow (the
    script's own argument), and it is named a data straggler; then rank 1 is SIGSTOPped, and it
    is named as the hang, with the all-reduce the survivor waits in."""
    job = subprocess.Popen(_run_cmd(agent_proc, "plain_ddp.py", "--epochs", "100000", "--slow-loader", "1:0.03"),
                           env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True,
                           stdout=subprocess.DEVNULL, stderr=open(tmp_path / "job.log", "w"))
    try:
        (inc,) = wait_for(lambda: [i for i in agent_proc.status()["incidents"] if i["kind"] == "straggler"], 60,
                          what="a straggler incident")
        assert inc["rank"] == 1 and inc["detail"]["cause"] == "data", inc
        victim = next(r for r in _ranks(agent_proc) if r["rank"] == 1)
        os.kill(victim["pid"], signal.SIGSTOP)
        t0 = time.monotonic()
        (inc,) = wait_for(lambda: [i for i in agent_proc.status()["incidents"] if i["kind"] == "hang"], 15,
                          what="a hang incident")
        assert time.monotonic() - t0 < 10.0
        d = inc["detail"]
        assert inc["rank"] == 1 and d["stopped"] is True and d["pid"] == victim["pid"], inc
        # The survivor's Flight Recorder: the all-reduce it waits in, which rank 1 never issued.
        pending = d["flight_recorder"]["0"]["pending"]
        assert any(e["op"] == "all_reduce" for e in pending), d["flight_recorder"]
        os.kill(victim["pid"], signal.SIGCONT)
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait(30)
