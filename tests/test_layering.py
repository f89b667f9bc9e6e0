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


def modules(folder: str) -> list[Path]:
    """Every module under ``folder``, its subpackages included (generated protobuf code aside)."""
    return sorted(p for p in (ROOT / folder).rglob("*.py") if "_pb2" not in p.name and "__pycache__" not in p.parts)


def dotted(path: Path) -> str:
    """The package a module at ``path`` is imported from (for relative imports)."""
    rel = path.relative_to(ROOT)
    return ".".join([PACKAGES[rel.parts[0]], *rel.parts[1:-1]])


def offending(folder: str, forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    found = {}
    for path in modules(folder):
        bad = sorted(m for m in imported_modules(path, dotted(path))
                     if any(m == f or m.startswith(f + ".") for f in forbidden))
        if bad:
            found[str(path.relative_to(ROOT))] = bad
    return found


def test_hooks_import_nothing_from_the_agent():
    assert list((ROOT / "hooks").glob("*.py")), "no hooks found"
    assert offending("hooks", ("rankwatch.agent",)) == {}


def test_shared_modules_import_neither_side_nor_torch():
    # What both sides share must not bring either side (or torch, which the agent never
    # imports) along with it.
    assert offending("rankwatch", ("rankwatch.agent", "rankwatch.hooks", "torch")) == {}


# Exporters (agent/export/, the GPU monitor's gauges) read what the detectors, the job and the
# views hold; nothing they read reaches back into an exporter.  Only the server, which wires
# the exporters to what they read, imports them.
# (``rankwatch.agent.rpc.listeners`` serves the registry the server fills, and the DCGM source
# parses dcgm-exporter's text with ``prometheus_client.parser``: neither exports anything.)
EXPORTERS = ("rankwatch.agent.export", "rankwatch.agent.gpu.gauges", "prometheus_client.core",
             "prometheus_client.metrics", "prometheus_client.registry", "opentelemetry")
MAY_IMPORT_EXPORTERS = ("agent/server.py", "agent/export/", "agent/gpu/gauges.py", "agent/gpu/__init__.py")


def test_only_the_server_and_the_exporters_import_an_exporter():
    assert (ROOT / "agent" / "export" / "prom_node.py").exists()
    found = {k: v for k, v in offending("agent", EXPORTERS).items()
             if not any(k == allowed or k.startswith(allowed) for allowed in MAY_IMPORT_EXPORTERS)}
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


# The agent's folders, lowest first: a module imports only from its own folder and the folders
# before it, so no import runs back up (type-only imports too).  ``config.py`` (the parts'
# configurations composed) and ``server.py`` (the parts wired) sit above the folders they
# compose, and the command line above everything: it starts the agent.
AGENT_ORDER = ("wire", "detect", "durable", "gpu", "node", "relays", "job", "link", "rpc", "views", "export",
               "analyze", "config", "server", "cli")


def _folder_imports() -> dict[str, set[str]]:
    """Per agent module (``folder/name.py``), the agent folders (or top modules) it imports."""
    out: dict[str, set[str]] = {}
    for path in modules("agent"):
        rel = path.relative_to(ROOT / "agent")
        if len(rel.parts) < 2:
            continue
        dst = {m.split(".")[2] for m in imported_modules(path, dotted(path))
               if m.startswith("rankwatch.agent.") and m.count(".") >= 2}
        out[str(rel)] = dst
    return out


def test_the_agent_folders_import_only_downwards():
    rank = {name: i for i, name in enumerate(AGENT_ORDER)}
    found = {}
    for module, targets in _folder_imports().items():
        folder = module.split("/")[0]
        assert folder in rank, f"{folder}/ is not in AGENT_ORDER: place it"
        up = sorted(t for t in targets if t != folder and rank.get(t, len(AGENT_ORDER)) > rank[folder])
        if up:
            found[module] = up
    assert found == {}
