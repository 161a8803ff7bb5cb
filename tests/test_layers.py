"""Imports point down the layers of DESIGN.md only."""

from __future__ import annotations

import ast

import pytest

from tests.conftest import ROOT

PACKAGE = ROOT / "psframe"

# module -> layer; a module may import psframe modules of its own layer and
# of the layers listed in ALLOWED for it.
LAYER_OF = {
    "psframe.errors": "core",
    "psframe.version": "core",
    "psframe.cluster": "core",
    "psframe.tf_config": "core",
    "psframe.device_spec": "core",
    "psframe.placement": "core",
    "psframe.optim": "core",
    "psframe.allocator": "core",
    "psframe.proto": "wire",
    "psframe.proto.psframe_pb2": "wire",
    "psframe.codec": "wire",
    "psframe.checkpoint_io": "wire",
    "psframe.checkpoint_slices": "wire",
    "psframe.ps": "ps",
    "psframe.ps.store": "ps",
    "psframe.ps.sync": "ps",
    "psframe.ps.service": "ps",
    "psframe.ps.task_service": "ps",
    "psframe.ps.server": "ps",
    "psframe.ps.recovery": "ps",
    "psframe.ps.roster": "ps",
    "psframe.client": "worker",
    "psframe.trainer": "worker",
    "psframe.staging": "worker",
    "psframe.hooks": "worker",
    "psframe.checkpoint": "worker",
    "psframe.cli": "edge",
    "psframe.launch": "edge",
    "psframe": "edge",
}
ALLOWED = {
    "core": {"core"},
    "wire": {"wire", "core"},
    "ps": {"ps", "wire", "core"},
    "worker": {"worker", "wire", "core"},
    "edge": {"edge", "worker", "ps", "wire", "core"},
}
# Third-party packages per layer: core is stdlib only (optim wraps torch.optim).
THIRD_PARTY_OF_CORE = {"psframe.optim": {"torch"}}


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
    while name:
        if name in LAYER_OF:
            return LAYER_OF[name]
        name = name.rpartition(".")[0]
    return None


SOURCES = sorted(p for p in PACKAGE.rglob("*.py") if not p.name.endswith("_pb2.py"))


def test_every_module_has_a_layer():
    assert SOURCES
    missing = [module_name(p) for p in SOURCES if module_name(p) not in LAYER_OF]
    assert not missing, f"give these modules a layer in tests/test_layers.py: {missing}"


@pytest.mark.parametrize("path", SOURCES, ids=module_name)
def test_imports_point_down(path):
    me = module_name(path)
    mine = LAYER_OF[me]
    for imported in imports_of(path):
        if not imported.startswith("psframe"):
            if mine == "core" and imported.split(".")[0] not in THIRD_PARTY_OF_CORE.get(me, set()):
                assert imported.split(".")[0] in _stdlib(), f"{me} (core) imports {imported}"
            continue
        theirs = layer(imported)
        if theirs is None or imported == "psframe":
            continue
        assert theirs in ALLOWED[mine], f"{me} ({mine}) must not import {imported} ({theirs})"


def _stdlib() -> set[str]:
    import sys

    return set(sys.stdlib_module_names) | {"__future__"}
