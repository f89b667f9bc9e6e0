"""Imports follow the data flow: the training side never reaches into the node side.

``hooks/`` (in every rank) and ``agent/`` (on every node) share only the small modules of
the ``rankwatch`` package itself, which import neither of them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Where each package's folder maps in the ``rankwatch`` namespace (pyproject.toml).
PACKAGES = {"hooks": "rankwatch.hooks", "agent": "rankwatch.agent", "rankwatch": "rankwatch"}


def imported_modules(path: Path, package: str) -> set[str]:
    """Every module ``path`` imports, at any depth of the file, relative imports resolved."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            out.add(module)
            out.update(f"{module}.{alias.name}" for alias in node.names)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", ""))
              in ("import_module", "__import__") and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            out.add(node.args[0].value)
    return out


def offending(folder: str, forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    found = {}
    for path in sorted((ROOT / folder).glob("*.py")):
        bad = sorted(m for m in imported_modules(path, PACKAGES[folder])
                     if any(m == f or m.startswith(f + ".") for f in forbidden))
        if bad:
            found[f"{folder}/{path.name}"] = bad
    return found


def test_hooks_import_nothing_from_the_agent():
    assert list((ROOT / "hooks").glob("*.py")), "no hooks found"
    assert offending("hooks", ("rankwatch.agent",)) == {}


def test_shared_modules_import_neither_side_nor_torch():
    # What both sides share must not bring either side (or torch, which the agent never
    # imports) along with it.
    assert offending("rankwatch", ("rankwatch.agent", "rankwatch.hooks", "torch")) == {}


# The detectors and the decisions: what is wrong, and what to do about it.  Exporters read
# them (agent/export/); they never reach into an exporter.
DETECTORS = ("hang", "straggler", "evaluate", "nodewatch", "rankstate", "rankexit", "starvation",
             "stepstarts", "checkpoint_policy", "goodput", "coordinator", "decisions", "incidents", "state")


def test_detectors_import_no_exporter():
    assert (ROOT / "agent" / "export" / "metrics.py").exists()
    found = {}
    for name in DETECTORS:
        path = ROOT / "agent" / f"{name}.py"
        bad = sorted(m for m in imported_modules(path, "rankwatch.agent")
                     if m == "rankwatch.agent.export" or m.startswith("rankwatch.agent.export.")
                     or m in ("prometheus_client", "opentelemetry") or m.startswith("opentelemetry."))
        if bad:
            found[name] = bad
    assert found == {}


@pytest.mark.parametrize("source,package,want", [
    ("from rankwatch.agent.address import Address", "rankwatch.hooks", "rankwatch.agent.address"),
    ("import rankwatch.agent.server", "rankwatch.hooks", "rankwatch.agent.server"),
    ("from ..agent import address", "rankwatch.hooks", "rankwatch.agent.address"),
    ("def f():\n    from rankwatch.agent.client import fetch_status", "rankwatch.hooks",
     "rankwatch.agent.client.fetch_status"),
    ("importlib.import_module('rankwatch.agent.server')", "rankwatch.hooks", "rankwatch.agent.server"),
])
def test_the_check_sees_every_form_of_import(tmp_path, source, package, want):
    path = tmp_path / "m.py"
    path.write_text(source + "\n")
    assert want in imported_modules(path, package)
