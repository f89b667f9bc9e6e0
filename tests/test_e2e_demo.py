"""`rankwatch demo`, the main job: three nodes and a spare; a straggler, a GPU risk, a hang, a fatal XID."""

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
    for kind in ("straggler", "checkpoint", "hang", "restart", "gpu_fault"):
        assert kind in timeline, (kind, timeline[-3000:])
    assert "gpu risk" in timeline and "demo-n2" in timeline
    # The spare took the hung node's place, and the fatal XID came once it trained.
    assert "demo-n3 took demo-n2's place" in out, out[-4000:]
    final = out[out.index("final view"):out.index("timeline")]
    assert "demo-n3" in final and "demo-n0" in final
    # The restarts stop every rank for a while; that is not a hang of the spare's rank.
    assert "demo-n3" not in [line.split("│")[3].strip() for line in timeline.splitlines()
                             if line.count("│") > 3 and " hang " in line], timeline[-3000:]
    assert "goodput" in out and "nodes exited with [0, 0, 0, 0]" in out
