"""The harness's pipeline, expert and context parallelism in real torchrun jobs under
``rankwatch run`` (2 ranks each, a few steps): the job trains, and its mesh dimensions
(``pp``, ``ep``, ``cp``) are in ``status --json``."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from conftest import AgentProcess

pytestmark = pytest.mark.e2e

LAYOUTS = {
    "pp2_1f1b": (["--pp", "2", "--layers", "3", "--pp-split", "1,2"], {"pp": 2, "dp": 1, "tp": 1}),
    "pp2_gpipe": (["--pp", "2", "--pp-schedule", "gpipe", "--microbatches", "4"], {"pp": 2, "dp": 1, "tp": 1}),
    "ep2": (["--ep", "2", "--experts", "4", "--top-k", "2"], {"dp": 1, "ep": 2, "tp": 1}),
    "cp2": (["--cp", "2"], {"dp": 1, "cp": 2, "tp": 1}),
}


def run_harness(agent: AgentProcess, nproc: int, *args: str, timeout: float = 300) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "rankwatch.agent.cli", "run", "--agent", str(agent.addr), "--node-id", "n0",
         "--", "--standalone", "--nproc-per-node", str(nproc), "-m", "rankwatch.hooks.train", *args],
        capture_output=True, text=True, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_layout_trains_and_its_mesh_is_in_status(tmp_path, layout):
    flags, shape = LAYOUTS[layout]
    agent = AgentProcess(tmp_path / "agent.sock").start()
    try:
        run_harness(agent, 2, "--steps", "12", "--metrics-out", str(tmp_path / "m"), *flags)
        ranks = sorted(agent.status()["ranks"], key=lambda r: r["rank"])
    finally:
        agent.stop()
    assert [r["step"] for r in ranks] == [12, 12]
    dim = next(d for d in ("pp", "ep", "cp") if d in shape)
    assert [r["mesh"][dim] for r in ranks] == [0, 1], ranks
    assert all(r["mesh"].keys() == shape.keys() for r in ranks), ranks
    runs = [json.loads((tmp_path / "m" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(math.isfinite(x) for run in runs for x in run["losses"])
    if dim == "pp":  # the last stage's loss, on both stages
        assert runs[0]["losses"] == runs[1]["losses"]
    else:  # the data-parallel mean is the same everywhere
        assert runs[0]["dp_mean_losses"] == pytest.approx(runs[1]["dp_mean_losses"])
