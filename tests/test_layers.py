"""Imports point down the layers of DESIGN.md only."""

from __future__ import annotations

import ast

import pytest

from tests.conftest import ROOT

PACKAGE = ROOT / "psframe"

# module or package -> layer; a module may import psframe modules of its own
# layer and of the layers listed in ALLOWED for it. A package's entry covers
# every module in it.
LAYER_OF = {
    "psframe.errors": "core",
    "psframe.version": "core",
    "psframe.optim": "core",
    "psframe.sparse_optim": "core",
    "psframe.dynamic_rows": "core",
    "psframe.allocator": "core",
    "psframe.huge_pages": "core",
    "psframe.security": "core",
    "psframe.liveness": "core",
    "psframe.cluster": "core",
    "psframe.wire": "wire",
    "psframe.checkpoint": "storage",
    "psframe.ps": "ps",
    "psframe.worker": "worker",
    "psframe.hooks": "worker",
    "psframe.cli": "edge",
    "psframe.launch": "edge",
    "psframe.ray": "edge",
    "psframe.k8s": "edge",
    "psframe.spark": "edge",
    "psframe": "edge",
}
ALLOWED = {
    "core": {"core"},
    "wire": {"wire", "core"},
    "storage": {"storage", "core"},
    "ps": {"ps", "storage", "wire", "core"},
    "worker": {"worker", "storage", "wire", "core"},
    "edge": {"edge", "worker", "ps", "storage", "wire", "core"},
}
# Third-party packages per layer: core is stdlib only (optim wraps torch.optim).
THIRD_PARTY_OF_CORE = {
    "psframe.optim": {"torch"},
    "psframe.sparse_optim": {"torch"},
    "psframe.huge_pages": {"torch"},
    "psframe.dynamic_rows": {"torch", "numpy"},
}


def module_name(path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def layer(name: str) -> str | None:
    """The layer of a module, from its own entry or its package's; the root's
    entry covers ``psframe/__init__.py`` only."""
    if name == "psframe":
        return LAYER_OF[name]
    while "." in name:
        if name in LAYER_OF:
            return LAYER_OF[name]
        name = name.rpartition(".")[0]
    return None


SOURCES = sorted(p for p in PACKAGE.rglob("*.py") if not p.name.endswith("_pb2.py"))


def test_every_module_has_a_layer():
    assert SOURCES
    missing = [module_name(p) for p in SOURCES if layer(module_name(p)) is None]
    assert not missing, f"give these modules a layer in tests/test_layers.py: {missing}"


@pytest.mark.parametrize("path", SOURCES, ids=module_name)
def test_imports_point_down(path):
    me = module_name(path)
    mine = layer(me)
    for imported in imports_of(path):
        if not imported.startswith("psframe"):
            if mine == "core" and imported.split(".")[0] not in THIRD_PARTY_OF_CORE.get(me, set()):
                assert imported.split(".")[0] in _stdlib(), f"{me} (core) imports {imported}"
            continue
        theirs = layer(imported)
        if imported == "psframe":
            continue
        assert theirs is not None, f"{me} imports {imported}, which has no layer"
        assert theirs in ALLOWED[mine], f"{me} ({mine}) must not import {imported} ({theirs})"


def _stdlib() -> set[str]:
    import sys

    return set(sys.stdlib_module_names) | {"__future__"}


def test_a_worker_process_loads_nothing_of_the_ps_side():
    import subprocess
    import sys

    code = (
        "import sys, psframe, psframe.hooks, psframe.checkpoint; psframe.Trainer; "
        "print(sorted(m for m in sys.modules if m.startswith('psframe.ps')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT, check=True
    ).stdout
    assert out.strip() == "[]"


def test_the_trainer_speaks_tensors_and_names_only():
    for path in (PACKAGE / "worker").glob("*.py"):
        # The client, its streams and prepared requests (and the replica's on-GPU compression) speak wire.
        if path.stem in ("client", "streams", "prepared", "replica"):
            continue
        wire = {name for name in imports_of(path) if name.startswith("psframe.wire")}
        assert not wire, f"{module_name(path)} imports {sorted(wire)}"
