"""The house rules: folders that show the architecture, modules small enough to read.

- ``agent/`` and ``hooks/`` keep few modules at their top; the rest lives in subpackages
  named for what they own (docs/architecture.md says why each is cut so).
- No module over 400 lines, no function of 80 lines or more.
- No two modules of one side whose names differ only by a plural, a prefix or a suffix
  (``view``/``views``, ``straggler``/``jobstragglers``, ``validate``/``validate_stream``).
- Every module says in its first docstring line what it owns.
- No import cycle, type-only imports included.
"""

from __future__ import annotations

import ast
import itertools
import re
from pathlib import Path

import pytest

from test_layering import PACKAGES, ROOT, dotted, imported_modules, modules

SIDES = ("agent", "hooks")
TOP_LEVEL_MAX = {"agent": 20, "hooks": 12}
MODULE_LINES = 400
FUNCTION_LINES = 80


def _all_modules() -> list[Path]:
    return [p for side in (*SIDES, "rankwatch") for p in modules(side)]


def _name(path: Path) -> str:
    """The module's import name (a package's ``__init__`` is the package)."""
    rel = path.relative_to(ROOT)
    name = ".".join([PACKAGES[rel.parts[0]], *rel.parts[1:]])[: -len(".py")]
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


@pytest.mark.parametrize("side", SIDES)
def test_few_modules_at_the_top_of_each_side(side):
    top = [p.name for p in (ROOT / side).glob("*.py")]
    assert 0 < len(top) <= TOP_LEVEL_MAX[side], sorted(top)
    assert [p for p in (ROOT / side).iterdir() if p.is_dir() and (p / "__init__.py").exists()], \
        f"{side}/ has no subpackages"


def test_no_module_is_too_long():
    long = {str(p.relative_to(ROOT)): n for p in _all_modules()
            if (n := p.read_text().count("\n")) > MODULE_LINES}
    assert long == {}


def test_no_function_is_too_long():
    long = {}
    for path in _all_modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if (n := node.end_lineno - node.lineno + 1) > FUNCTION_LINES:
                    long[f"{path.relative_to(ROOT)}:{node.name}"] = n
    assert long == {}


def _too_alike(a: str, b: str) -> bool:
    """``b`` is ``a`` with a plural, or with a prefix or suffix word (glued, or after ``_``)."""
    if a == b or b == a + "s":
        return True
    if b.startswith(a + "_") or b.endswith("_" + a):
        return True
    return len(a) >= 4 and (b.startswith(a) or b.endswith(a))


@pytest.mark.parametrize("a,b,alike", [
    ("view", "views", True), ("view", "jobview", True), ("straggler", "jobstragglers", False),
    ("stragglers", "jobstragglers", True), ("validate", "validate_stream", True), ("hang", "hang_end", True),
    ("gate", "prom_gate", True), ("hang_verdict", "hang_end", False), ("checkpoints", "checkpoint_due", False),
])
def test_the_name_check_sees_what_it_must(a, b, alike):
    assert (_too_alike(a, b) or _too_alike(b, a)) is alike


@pytest.mark.parametrize("side", SIDES)
def test_no_two_module_names_differ_only_by_a_plural_or_a_prefix(side):
    names = sorted({p.stem for p in modules(side)} - {"__init__", "__main__"})
    clashes = [(a, b) for a, b in itertools.permutations(names, 2) if _too_alike(a, b)]
    # Two files of one name in different subpackages count as well.
    stems = [p.stem for p in modules(side) if p.stem not in ("__init__", "__main__")]
    twice = sorted({s for s in stems if stems.count(s) > 1})
    assert clashes == [] and twice == []


def test_every_module_says_what_it_owns():
    silent = [str(p.relative_to(ROOT)) for p in _all_modules()
              if not (ast.get_docstring(ast.parse(p.read_text())) or "").strip()]
    assert silent == []


def _graph() -> dict[str, set[str]]:
    """Module -> the project's modules it imports, type-only imports included.

    ``from pkg import sub`` counts as an import of ``pkg.sub`` alone, and a package's own
    ``__init__`` (which always runs first) is not counted as a dependency of its modules."""
    paths = {_name(p): p for p in _all_modules()}
    graph = {}
    for name, path in paths.items():
        imported = imported_modules(path, dotted(path))
        deps = set()
        for m in imported:
            if name.startswith(m + ".") or any(o.startswith(m + ".") and o in paths for o in imported):
                continue
            parts = m.split(".")
            for n in range(len(parts), 0, -1):
                candidate = ".".join(parts[:n])
                if candidate in paths:
                    if candidate != name:
                        deps.add(candidate)
                    break
        graph[name] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_the_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_type_only_imports_included():
    assert _cycles(_graph()) == []


def test_the_architecture_page_maps_every_module():
    page = (ROOT / "docs" / "architecture.md").read_text()
    start, end = page.index("<!-- module map: start -->"), page.index("<!-- module map: end -->")
    listed = set(re.findall(r"^- `([\w/]+\.py)`", page[start:end], re.M))
    present = {str(p.relative_to(ROOT)) for p in _all_modules()}
    assert (present - listed, listed - present) == (set(), set()), "run python3 docs/module_map.py"
