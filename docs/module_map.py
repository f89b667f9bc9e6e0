"""Rewrite the module map in docs/architecture.md from the modules' own docstrings.

    python3 docs/module_map.py

Each module is listed under its subpackage with the first paragraph of its docstring;
``tests/test_house.py`` fails while a module is missing from the map or the map names one
that is gone.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "architecture.md"
START, END = "<!-- module map: start -->", "<!-- module map: end -->"
SIDES = ("agent", "hooks", "rankwatch")


def entry(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    first = doc.split("\n\n")[0].replace("\n", " ")
    first = re.sub(r":(?:class|func|mod|meth|data|attr):`~?([^`]+)`", r"`\1`", first).replace("``", "`")
    return f"- `{path.relative_to(ROOT).as_posix()}` — {first}"


def module_map() -> str:
    groups: dict[str, list[str]] = {}
    for side in SIDES:
        for path in sorted((ROOT / side).rglob("*.py")):
            if "_pb2" in path.name or "__pycache__" in path.parts:
                continue
            groups.setdefault(path.parent.relative_to(ROOT).as_posix() + "/", []).append(entry(path))
    lines = [START]
    for group in sorted(groups, key=lambda g: (SIDES.index(g.split("/")[0]), g)):
        lines += ["", f"**`{group}`**", "", *groups[group]]
    return "\n".join([*lines, "", END])


def main() -> None:
    page = PAGE.read_text()
    start, end = page.index(START), page.index(END) + len(END)
    PAGE.write_text(page[:start] + module_map() + page[end:])


if __name__ == "__main__":
    main()
