"""benchmarks/ is laid out as its map says (``benchmarks/__init__.py``): imports point down, never in a circle;
the suite uses psframe's public API, the baselines no psframe at all; every command named in the docs exists.

Imports are read with ``ast`` (function-level ones too), nothing is imported, so this runs in a second.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

BENCHMARKS = ROOT / "benchmarks"

# What a module may import of benchmarks/, by where it lives. Leaves import only other
# leaves (never in a circle: the test below); the suite may use the baselines (it starts them), never the reverse;
# the report and the command sit above the suite; only an experiment imports an experiment (one made of
# several modules: row_stores measures row_store_engines' engines).
LEAVES = {
    "benchmarks.common",
    "benchmarks.children",
    "benchmarks.formatting",
    "benchmarks.mlp_workload",
    "benchmarks.embedding_workload",
}
PACKAGES = {"benchmarks", "benchmarks.suite", "benchmarks.baselines", "benchmarks.experiments"}
ALLOWED = {
    "leaf": {"leaf"},
    "package": set(),
    "baselines": {"leaf", "baselines"},
    "suite": {"leaf", "baselines", "suite"},
    "experiments": {"leaf", "baselines", "suite", "experiments"},
    "top": {"leaf", "baselines", "suite", "top"},
}

# psframe's public modules (DESIGN: ``psframe.*`` plus the documented modules); of
# ``psframe.launch`` only the names in its ``__all__``.
PUBLIC_MODULES = {
    "psframe",
    "psframe.optim",
    "psframe.hooks",
    "psframe.checkpoint",
    "psframe.errors",
    "psframe.flags",
    "psframe.export",
    "psframe.streams",
    "psframe.streams.local_broker",
}
# The one suite module that may import psframe's internals, and why: the transport,
# security and memory sections time psframe's own client sending the trainer's step plan
# with no model around it, the scaling section counts that plan's messages, the
# sparse section measures how table placement splits a batch's ids, and the row rate
# calls a ps task's row path in process (its store, a dynamic table's part). It gathers
# those few internal names so that a refactor of psframe breaks the suite in one place.
INTERNALS_DOOR = "benchmarks.suite.psframe_internals"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


SOURCES = sorted(BENCHMARKS.rglob("*.py"))
MODULES = {module_name(p): p for p in SOURCES}


def where(name: str) -> str:
    """The part of benchmarks/ a module belongs to (a key of :data:`ALLOWED`)."""
    if name in LEAVES:
        return "leaf"
    if name in PACKAGES:
        return "package"
    for part in ("baselines", "suite", "experiments"):
        if name.startswith(f"benchmarks.{part}."):
            return part
    return "top"


def imports_of(path: Path) -> list[tuple[str, list[str]]]:
    """Every import in ``path``, at any depth: ``(module, [names imported from it])``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, [alias.name for alias in node.names]))
    return found


def benchmark_imports(path: Path) -> set[str]:
    """The benchmark modules ``path`` imports (``from benchmarks.suite import training`` counts as
    ``benchmarks.suite.training``)."""
    out = set()
    for module, names in imports_of(path):
        if module.split(".")[0] != "benchmarks":
            continue
        submodules = {f"{module}.{n}" for n in names} & MODULES.keys()
        out |= submodules or {module}
    return out


def declared_all(path: Path) -> set[str]:
    """The names in a module's ``__all__``, read from its source."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    raise AssertionError(f"{path} has no __all__")


def test_every_module_lives_where_the_map_says():
    assert {"benchmarks.run", "benchmarks.report", INTERNALS_DOOR, *LEAVES, *PACKAGES} <= MODULES.keys()
    folders = {BENCHMARKS, *(BENCHMARKS / part for part in ("suite", "baselines", "experiments"))}
    assert {p.parent for p in SOURCES} == folders, "a folder of benchmarks/ that benchmarks/__init__.py does not map"


@pytest.mark.parametrize("path", SOURCES, ids=module_name)
def test_imports_point_down_the_map(path):
    me = module_name(path)
    for imported in sorted(benchmark_imports(path)):
        assert imported in MODULES, f"{me} imports {imported}, which does not exist"
        assert where(imported) in ALLOWED[where(me)], (
            f"{me} ({where(me)}) must not import {imported} ({where(imported)}): see benchmarks/__init__.py"
        )


def test_no_import_circles():
    graph = {name: sorted(benchmark_imports(path) & MODULES.keys()) for name, path in MODULES.items()}
    state: dict[str, str] = {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for imported in graph[name]:
            if state.get(imported) == "open":
                circle = [*path[path.index(imported) :], imported]
                pytest.fail("import circle: " + " -> ".join(circle))
            if imported not in state:
                visit(imported, [*path, imported])
        state[name] = "done"

    for name in graph:
        if name not in state:
            visit(name, [name])


def test_the_suite_uses_psframes_public_api():
    public_names = declared_all(ROOT / "psframe" / "__init__.py")
    launch_helpers = declared_all(ROOT / "psframe" / "launch" / "__init__.py")
    for name, path in MODULES.items():
        if where(name) != "suite" or name == INTERNALS_DOOR:
            continue
        for module, names in imports_of(path):
            if module.split(".")[0] != "psframe":
                continue
            where_from = f"{name} imports {module} {names or ''}".rstrip()
            if module == "psframe.launch":
                assert set(names) <= launch_helpers, f"{where_from}: only psframe.launch's {sorted(launch_helpers)}"
            elif module == "psframe":
                for n in names:
                    assert n in public_names or f"psframe.{n}" in PUBLIC_MODULES, f"{where_from}: {n} is not public"
            else:
                assert module in PUBLIC_MODULES, f"{where_from}: internal; reach it through {INTERNALS_DOOR}"


def test_baselines_hold_no_psframe_code():
    for name, path in MODULES.items():
        if where(name) == "baselines":
            psframe = [m for m, _ in imports_of(path) if m.split(".")[0] == "psframe"]
            assert not psframe, f"{name} imports {psframe}: a baseline is a peer, not psframe"


def test_the_tensorflow_baseline_imports_the_standard_library_and_common_only():
    # It runs in .venv-tf, which has neither torch nor psframe: what it imports, and the
    # packages and module it passes through, must import nothing else.
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    for name, extra in (
        ("benchmarks.baselines.tf_ps", {"numpy", "tensorflow", "benchmarks"}),
        ("benchmarks.common", set()),
        ("benchmarks", set()),
        ("benchmarks.baselines", set()),
    ):
        modules = {m.split(".")[0] for m, _ in imports_of(MODULES[name])}
        assert modules <= stdlib | extra, f"{name} imports {sorted(modules - stdlib - extra)}"
    assert benchmark_imports(MODULES["benchmarks.baselines.tf_ps"]) == {"benchmarks.common"}


# `python -m benchmarks.<module>` and `benchmarks/<path>.py`, wherever the project names a benchmark.
NAMED = re.compile(r"-m (benchmarks(?:\.\w+)+)|\b(benchmarks/[\w/]+\.py)\b")
DOCUMENTS = [
    ROOT / "README.md",
    ROOT / "setup.cfg",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "scripts").glob("*.sh")),
    *sorted((ROOT / "psframe").rglob("*.py")),
    *SOURCES,
    *sorted((ROOT / "tests").glob("test_benchmark*.py")),
]


def test_every_benchmark_command_named_exists():
    stale = []
    for document in DOCUMENTS:
        for module, path in NAMED.findall(document.read_text()):
            if module and module not in MODULES:
                stale.append(f"{document.relative_to(ROOT)}: python -m {module}")
            elif path and not (ROOT / path).is_file():
                stale.append(f"{document.relative_to(ROOT)}: {path}")
    assert not stale, "these name benchmarks that do not exist (see benchmarks/__init__.py):\n" + "\n".join(stale)
