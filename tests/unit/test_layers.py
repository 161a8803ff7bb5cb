"""Imports point down the layers of DESIGN.md only: the folders are the layers.

This file holds the unit tier's tests of the subject; `tests/cluster/test_layers.py` holds the other
tiers'.
"""

from __future__ import annotations

import ast

import pytest

from tests.conftest import ROOT

PACKAGE = ROOT / "psframe"

# The layers, bottom first: each entry is a package (every module in it) or a
# top-level module. A module may import its own entry and the entries of the
# layers below; entries of one layer never import each other (ps and worker
# above all), except the edges, which start a cluster and may use one another.
LAYERS = (
    ("root", ("psframe.errors", "psframe.version")),
    ("kernels", ("psframe.optim", "psframe.memory")),
    ("status", ("psframe.status",)),
    ("cluster", ("psframe.cluster",)),
    ("config", ("psframe.config", "psframe.streams")),
    ("tables", ("psframe.tables",)),
    ("wire", ("psframe.wire",)),
    ("checkpoint", ("psframe.checkpoint",)),
    ("sides", ("psframe.ps", "psframe.worker")),
    ("helpers", ("psframe.flags", "psframe.export", "psframe.hooks")),
    (
        "edges",
        (
            "psframe",
            "psframe.cli",
            "psframe.launch",
            "psframe.local",
            "psframe.k8s",
            "psframe.ray",
            "psframe.spark",
            "psframe.serve",
        ),
    ),
)
SIDEWAYS = {"edges"}
BELOW_WIRE = {name for name, _ in LAYERS[: [name for name, _ in LAYERS].index("wire")]}
# Below the wire: the standard library only, but where torch (and numpy) is the point, and the
# store under a table's disk tier (LMDB: docs/decisions.md says why), and a stream's broker client.
THIRD_PARTY_BELOW_WIRE = {
    "psframe.optim": {"torch"},
    "psframe.memory": {"torch"},
    "psframe.tables": {"torch", "numpy", "lmdb"},
    "psframe.streams": {"nats"},  # the JetStream client, imported when a JetStream is made
}
# Inside each side, its packages bottom first (a module at the side's top level, such as
# psframe.worker.trainer, is above them all); psframe.ps.recovery sits beside elastic.
SUBLAYERS = {
    "psframe.ps": (("store",), ("protocol",), ("elastic", "recovery"), ("service",), ("serving",)),
    "psframe.worker": (("plan",), ("client",), ("model",), ("session",)),
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


def entry(name: str) -> tuple[int, str] | None:
    """The layer (its index) and the entry a module belongs to; the root's entry,
    ``psframe``, covers ``psframe/__init__.py`` only."""
    for index, (_, entries) in enumerate(LAYERS):
        for each in entries:
            if name == each or (each != "psframe" and name.startswith(each + ".")):
                return index, each
    return None


def sublayer(name: str) -> int | None:
    """The rank of a module's package inside its side (None: not on a side); a
    module at the side's top level ranks above every package."""
    for side, packages in SUBLAYERS.items():
        if name.startswith(side + "."):
            first = name[len(side) + 1 :].split(".")[0]
            return next((rank for rank, names in enumerate(packages) if first in names), len(packages))
    return None


SOURCES = sorted(p for p in PACKAGE.rglob("*.py") if not p.name.endswith("_pb2.py"))


def test_every_module_has_a_layer():
    assert SOURCES
    missing = [module_name(p) for p in SOURCES if entry(module_name(p)) is None]
    assert not missing, (
        f"give these modules a layer in tests/unit/test_layers.py (a package, or a top-level entry): {missing}"
    )


def test_every_package_on_a_side_has_a_place():
    for side, packages in SUBLAYERS.items():
        folder = PACKAGE / side.split(".")[1]
        placed = {name for names in packages for name in names}
        found = {p.name for p in folder.iterdir() if (p / "__init__.py").is_file()}
        assert found <= placed, f"place {sorted(found - placed)} among {side}'s packages in tests/unit/test_layers.py"
        assert {p for p in placed if p != "recovery"} <= found, f"{sorted(placed - found)} are gone from {side}"


@pytest.mark.parametrize("path", SOURCES, ids=module_name)
def test_imports_point_down(path):
    me = module_name(path)
    mine, my_entry = entry(me)
    layer_name = LAYERS[mine][0]
    for imported in imports_of(path):
        if not imported.startswith("psframe"):
            if layer_name in BELOW_WIRE:
                allowed = _stdlib() | THIRD_PARTY_BELOW_WIRE.get(my_entry, set())
                assert imported.split(".")[0] in allowed, f"{me} ({layer_name}) imports {imported}"
            continue
        if imported == "psframe":
            continue
        found = entry(imported)
        assert found is not None, f"{me} imports {imported}, which has no layer"
        theirs, their_entry = found
        sideways = theirs == mine and (their_entry == my_entry or layer_name in SIDEWAYS)
        assert theirs < mine or sideways, f"{me} ({my_entry}) must not import {imported} ({their_entry})"


@pytest.mark.parametrize("path", [p for p in SOURCES if sublayer(module_name(p)) is not None], ids=module_name)
def test_inside_each_side_imports_point_down(path):
    me = module_name(path)
    mine = sublayer(me)
    for imported in imports_of(path):
        theirs = sublayer(imported)
        if theirs is not None and imported.split(".")[:2] == me.split(".")[:2]:
            assert theirs <= mine, f"{me} must not import {imported}, a package above it (tests/unit/test_layers.py)"


def _stdlib() -> set[str]:
    import sys

    return set(sys.stdlib_module_names) | {"__future__"}


def test_the_trainer_speaks_tensors_and_names_only():
    # The client package (its streams, the operations encoder, prepared requests) speaks wire,
    # and so does the replica's on-GPU compression.
    speaks_wire = {PACKAGE / "worker" / "model" / "replica.py"}
    for path in (PACKAGE / "worker").rglob("*.py"):
        if path.parent.name == "client" or path in speaks_wire:
            continue
        wire = {name for name in imports_of(path) if name.startswith("psframe.wire")}
        assert not wire, f"{module_name(path)} imports {sorted(wire)}"


# DESIGN: the store and the barrier never touch the network, so they are tested
# in milliseconds. Neither the store and its parts (psframe.ps.store), nor the
# rules between workers (psframe.ps.protocol: the barrier, the ledger, staleness...),
# nor the rows of dynamic tables, import the wire (the service translates for them).
PLAIN_TORCH = sorted(
    {
        *(PACKAGE / "ps" / "store").glob("*.py"),
        *(PACKAGE / "ps" / "protocol").glob("*.py"),
        PACKAGE / "tables" / "dynamic_rows.py",
        PACKAGE / "tables" / "id_index.py",
        PACKAGE / "tables" / "eviction.py",
        PACKAGE / "tables" / "change_stamps.py",
        PACKAGE / "tables" / "admission.py",
    }
)


def _is_wire(name: str) -> bool:
    parts = name.split(".")
    return parts[0] == "grpc" or name.startswith("psframe.wire") or "psframe_pb2" in parts


@pytest.mark.parametrize("path", PLAIN_TORCH, ids=module_name)
def test_the_store_and_the_barrier_never_see_the_wire(path):
    assert path.exists(), f"{path} is gone: update PLAIN_TORCH in tests/unit/test_layers.py"
    wire = sorted(name for name in imports_of(path) if _is_wire(name))
    assert not wire, f"{module_name(path)} imports {wire}: only the service translates between the wire and the store"


# The store and its parts are given a memory policy (psframe.memory, or the ps
# task's shared memory: psframe.ps.serving.store_memory) and name no memory of their own.
MEMORY_MACHINERY = ("psframe.memory.huge_pages", "psframe.memory.malloc", "psframe.ps.serving")
STORE = sorted(
    {
        *(PACKAGE / "ps" / "store").glob("*.py"),
        PACKAGE / "tables" / "dynamic_rows.py",
        PACKAGE / "tables" / "id_index.py",
        PACKAGE / "tables" / "eviction.py",
        PACKAGE / "tables" / "change_stamps.py",
        PACKAGE / "tables" / "admission.py",
    }
)


@pytest.mark.parametrize("path", STORE, ids=module_name)
def test_the_store_names_no_memory_of_its_own(path):
    named = sorted(name for name in imports_of(path) if name.startswith(MEMORY_MACHINERY))
    assert not named, f"{module_name(path)} imports {named}: it is given a psframe.memory.Memory instead"


# Serving processes (psframe.ps.serving) wrap the plain service, never the other way round.
@pytest.mark.parametrize("path", sorted((PACKAGE / "ps" / "service").glob("*.py")), ids=module_name)
def test_the_service_knows_nothing_of_serving_processes(path):
    named = sorted(name for name in imports_of(path) if name.startswith("psframe.ps.serving"))
    assert not named, f"{module_name(path)} imports {named}: serving processes wrap the service instead"


# psframe serve's web framework is the serve extra's: only psframe.serve imports it, so that a
# training process (or psframe.cli, which lists every command) never loads it.
WEB_FRAMEWORK = ("starlette", "uvicorn", "fastapi")


@pytest.mark.parametrize(
    "path", [p for p in SOURCES if not module_name(p).startswith("psframe.serve")], ids=module_name
)
def test_only_psframe_serve_imports_the_web_framework(path):
    named = sorted(name for name in imports_of(path) if name.split(".")[0] in WEB_FRAMEWORK)
    assert not named, f"{module_name(path)} imports {named}: only psframe.serve may (the serve extra)"
