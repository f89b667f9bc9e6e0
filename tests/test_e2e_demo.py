"""`rankwatch demo`, the main job: three nodes, a straggler, a GPU risk, a hang, an exclusion."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e


def test_demo_runs_and_tells_the_story(tmp_path):
    # Its own default address, so a developer's running agent is not in the way.
    env = {**os.environ, "RANKWATCH_AGENT": str(tmp_path / "demo.sock"), "COLUMNS": "200"}
    r = subprocess.run([sys.executable, "-m", "rankwatch.agent.cli", "demo", "--no-live"],
                       capture_output=True, text=True, timeout=400, env=env)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    timeline = out[out.index("timeline"):]
    for kind in ("straggler", "checkpoint", "hang", "restart"):
        assert kind in timeline, (kind, timeline[-3000:])
    assert "gpu risk" in timeline and "demo-n2" in timeline
    assert "goodput" in out and "nodes exited with [0, 0, 0]" in out
