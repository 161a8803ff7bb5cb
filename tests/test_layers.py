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
    "psframe.optimizer_kernels": "core",
    "psframe.sparse_optim": "core",
    "psframe.dynamic_rows": "core",
    "psframe.admission": "core",
    "psframe.allocator": "core",
    "psframe.huge_pages": "core",
    "psframe.security": "core",
    "psframe.liveness": "core",
    "psframe.cluster": "core",
    "psframe.flags": "core",
    "psframe.options": "core",
    "psframe.memory": "core",
    "psframe.rows": "core",
    "psframe.status": "core",
    "psframe.wire": "wire",
    "psframe.checkpoint": "storage",
    "psframe.tensor_file": "storage",
    "psframe.export": "storage",
    "psframe.ps": "ps",
    "psframe.worker": "worker",
    "psframe.hooks": "worker",
    "psframe.cli": "edge",
    "psframe.launch": "edge",
    "psframe.local": "edge",
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
# Third-party packages per layer: core is stdlib only (optim and its kernels wrap torch.optim).
THIRD_PARTY_OF_CORE = {
    "psframe.optim": {"torch"},
    "psframe.sparse_optim": {"torch"},
    "psframe.optimizer_kernels": {"torch"},
    "psframe.memory": {"torch"},
    "psframe.rows": {"torch"},
    "psframe.huge_pages": {"torch"},
    "psframe.dynamic_rows": {"torch", "numpy"},
    "psframe.admission": {"torch", "numpy"},
}


def module_name(path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path) -> set[str]:
    """The modules (and names in them) ``path`` imports, relative imports made absolute."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module if node.level == 0 else _absolute(path, node.level, node.module)
            if module:
                names.add(module)
                names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def _absolute(path, level: int, module: str | None) -> str:
    """The module a relative import (``from ..x import y``: level 2, module x) in ``path`` names."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package.pop()
    base = package[: len(package) - (level - 1)]
    return ".".join([*base, module] if module else base)


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


@pytest.mark.cluster
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
        # The client, its streams, the operations encoder and prepared requests (and the replica's
        # on-GPU compression) speak wire.
        if path.stem in ("ps_client", "streams", "operations", "prepared", "replica"):
            continue
        wire = {name for name in imports_of(path) if name.startswith("psframe.wire")}
        assert not wire, f"{module_name(path)} imports {sorted(wire)}"


# DESIGN: the store and the barrier never touch the network, so they are tested
# in milliseconds. Neither they, nor the parts the store is made of, nor the rows
# of dynamic tables, import the wire (the service translates for them).
PLAIN_TORCH = sorted(
    {
        *(PACKAGE / "ps").glob("store*.py"),
        PACKAGE / "ps" / "optimized_variables.py",
        PACKAGE / "ps" / "table_parts.py",
        PACKAGE / "ps" / "sync.py",
        PACKAGE / "dynamic_rows.py",
        PACKAGE / "admission.py",
    }
)


def _is_wire(name: str) -> bool:
    parts = name.split(".")
    return parts[0] == "grpc" or name.startswith("psframe.wire") or "psframe_pb2" in parts


@pytest.mark.parametrize("path", PLAIN_TORCH, ids=module_name)
def test_the_store_and_the_barrier_never_see_the_wire(path):
    assert path.exists(), f"{path} is gone: update PLAIN_TORCH in tests/test_layers.py"
    wire = sorted(name for name in imports_of(path) if _is_wire(name))
    assert not wire, f"{module_name(path)} imports {wire}: only the service translates between the wire and the store"


# The store and its parts are given a memory policy (psframe.memory, or the ps
# task's shared memory: psframe.ps.store_memory) and name no memory of their own.
MEMORY_MACHINERY = ("psframe.huge_pages", "psframe.allocator", "psframe.ps.shared_store")


@pytest.mark.parametrize("path", [p for p in PLAIN_TORCH if p.stem not in ("store_memory", "sync")], ids=module_name)
def test_the_store_names_no_memory_of_its_own(path):
    named = sorted(name for name in imports_of(path) if name.startswith(MEMORY_MACHINERY))
    assert not named, f"{module_name(path)} imports {named}: it is given a psframe.memory.Memory instead"


# Serving processes wrap the plain service (psframe.ps.shared_service), never the other way round.
SERVING_MACHINERY = ("psframe.ps.shared_store", "psframe.ps.store_memory", "psframe.ps.serving_processes")


def test_the_service_knows_nothing_of_serving_processes():
    path = PACKAGE / "ps" / "service.py"
    named = sorted(
        name for name in imports_of(path) if name.startswith(SERVING_MACHINERY + ("psframe.ps.shared_service",))
    )
    assert not named, f"psframe.ps.service imports {named}: serving processes wrap the service instead"
