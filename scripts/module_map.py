#!/usr/bin/env python3
"""Writes docs/modules.md: every module of psframe, by package, with the summary of its docstring.

Usage: python scripts/module_map.py [--check]

The map is made from the code, so it cannot go stale: tests/unit/test_module_map.py
fails when docs/modules.md differs from what this script writes, and when a
module has no docstring to take its line from. With ``--check`` the script
only compares, and exits 1 on a difference.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "psframe"
OUTPUT = ROOT / "docs" / "modules.md"
GENERATED = {"psframe_pb2.py"}  # scripts/gen_proto.py makes it from psframe.proto

HEADER = """# Module map

Every module of psframe, by package, with the summary (first paragraph) of its docstring.
Written by `scripts/module_map.py` (a test fails when it differs). The top level holds
what users import or run; the packages are the layers, bottom to top: `psframe.optim`
and `psframe.memory`, `psframe.cluster`, `psframe.config`, `psframe.tables`,
`psframe.wire`, `psframe.checkpoint`, then the ps side (`psframe.ps`) and the worker
side (`psframe.worker`), which never import each other. What each may import is in
`tests/unit/test_layers.py`.
"""


class MissingDocstring(Exception):
    """A module without a docstring: it has no line in the map."""


def summary(path: Path) -> str:
    """The first paragraph of a module's docstring, on one line.

    Raises:
        MissingDocstring: the module has none.
    """
    docstring = ast.get_docstring(ast.parse(path.read_text()))
    if not docstring:
        raise MissingDocstring(f"{path.relative_to(ROOT)} has no docstring: say in one line what it holds")
    paragraph = docstring.strip().split("\n\n")[0]
    return " ".join(line.strip() for line in paragraph.splitlines())


def modules() -> list[Path]:
    """Every module and package of psframe, packages before the modules in them."""
    found = [p for p in PACKAGE.rglob("*.py") if p.name not in GENERATED and "__pycache__" not in p.parts]
    return sorted(found, key=lambda p: (p.parent.relative_to(ROOT).parts, p.name != "__init__.py", p.name))


def dotted(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def render() -> str:
    """The text of docs/modules.md."""
    lines = [HEADER]
    for path in modules():
        if path.name == "__init__.py":
            lines += ["", f"## `{dotted(path)}`", "", f"{summary(path)}", "", "| module | what it holds |", "|---|---|"]
        else:
            cell = summary(path).replace("|", "\\|")  # a pipe would end the table's cell
            lines.append(f"| `{path.stem}` | {cell} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with docs/modules.md; exit 1 on a difference")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OUTPUT.exists() or OUTPUT.read_text() != text:
            print(f"{OUTPUT.relative_to(ROOT)} is stale: run python scripts/module_map.py", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT.relative_to(ROOT)} ({len(modules())} modules)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
