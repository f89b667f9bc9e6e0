"""The agent side type-checks: mypy over ``rankwatch.agent`` and the shared modules.

The package maps ``rankwatch.agent`` onto ``agent/`` (pyproject.toml), which
mypy cannot follow from an editable install, so the test lays the package out
as it installs (links in a temporary folder) and checks it there.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_agent_side_type_checks(tmp_path):
    pkg = tmp_path / "rankwatch"
    pkg.mkdir()
    for f in (ROOT / "rankwatch").glob("*.py"):
        shutil.copy(f, pkg / f.name)
    for sub, folder in (("agent", "agent"), ("proto", "proto"), ("hooks", "hooks")):
        (pkg / sub).symlink_to(ROOT / folder, target_is_directory=True)
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--ignore-missing-imports", "--cache-dir", str(tmp_path / "cache"),
         "-p", "rankwatch.agent", "-m", "rankwatch.address", "-m", "rankwatch.status"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "Success" in out.stdout
