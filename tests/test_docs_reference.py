"""The reference pages name what the code has: environment variables, RPC methods, checkpoint fields.

Each test reads names from the code (the sources, the method table, the manifest's
dataclasses) and fails naming those a page of docs/reference/ leaves out, so that a
variable, a method or a field added to the code cannot go undocumented. Unit tier:
files and imports only.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from psframe.checkpoint import shard
from psframe.checkpoint.manifest import Manifest, ShardRecord, manifest_to_json
from psframe.wire import transport
from tests.conftest import ROOT

REFERENCE = ROOT / "docs" / "reference"
VARIABLE = re.compile(r"PSFRAME_[A-Z0-9_]+")


def _page(name: str) -> str:
    path = REFERENCE / name
    assert path.is_file(), f"{path.relative_to(ROOT)} is missing"
    return path.read_text()


def _named_in(folder: Path, patterns: tuple[str, ...] = ("*.py", "*.sh")) -> set[str]:
    """Every PSFRAME_* name written in the files of ``folder`` (generated protobuf code left out)."""
    found: set[str] = set()
    for pattern in patterns:
        for path in folder.rglob(pattern):
            if not path.name.endswith("_pb2.py"):
                found.update(VARIABLE.findall(path.read_text()))
    return found


def _code_spans(text: str) -> set[str]:
    """What the page writes as inline code: ```name``` (a name in prose does not count)."""
    return set(re.findall(r"`([^`\n]+)`", text))


def missing_variables(page: str, named: set[str]) -> list[str]:
    """The names of ``named`` the page does not document. A name ending in ``_`` is a prefix
    (``PSFRAME_TLS_*`` in a docstring): some variable the page names must start with it."""
    documented = set(VARIABLE.findall(page))
    return sorted(
        name
        for name in named
        if not (any(d.startswith(name) for d in documented) if name.endswith("_") else name in documented)
    )


def test_every_psframe_variable_is_in_the_environment_reference():
    named = _named_in(ROOT / "psframe") | _named_in(ROOT / "scripts")
    assert {"PSFRAME_AUTH_TOKEN", "PSFRAME_TUNE_MALLOC", "PSFRAME_HUGE_PAGES"} <= named, "the scan found too little"
    missing = missing_variables(_page("environment.md"), named)
    assert not missing, f"docs/reference/environment.md does not name {missing}, which psframe/ or scripts/ read"


def test_the_environment_reference_names_no_variable_the_code_lacks():
    known = _named_in(ROOT / "psframe") | _named_in(ROOT / "scripts") | _named_in(ROOT / "benchmarks")
    invented = sorted(set(VARIABLE.findall(_page("environment.md"))) - known)
    assert not invented, f"docs/reference/environment.md names {invented}, which nothing in the code reads"


def test_a_missing_or_prefixed_variable_is_told_apart():
    page = "`PSFRAME_KEEPALIVE_TIMEOUT` and `PSFRAME_TLS_CA_FILE`"
    named = {"PSFRAME_KEEPALIVE_TIME", "PSFRAME_KEEPALIVE_TIMEOUT", "PSFRAME_TLS_", "PSFRAME_HUGE_"}
    assert missing_variables(page, named) == ["PSFRAME_HUGE_", "PSFRAME_KEEPALIVE_TIME"]


def test_every_method_of_the_service_is_in_the_wire_protocol_reference():
    assert {"PushPull", "Init", "GetInfo"} <= set(transport.METHODS)
    spans = _code_spans(_page("wire-protocol.md"))
    missing = sorted(name for name in transport.METHODS if name not in spans)
    assert not missing, f"docs/reference/wire-protocol.md does not name the methods {missing} (as `Name`)"


def test_the_wire_protocol_reference_includes_the_whole_schema():
    page = _page("wire-protocol.md")
    assert '--8<-- "psframe/wire/psframe.proto"' in page, "the .proto is no longer included verbatim"
    assert (ROOT / "psframe" / "wire" / "psframe.proto").is_file()


def _manifest_fields() -> set[str]:
    """The manifest's fields: its dataclasses' and every key its writer puts in MANIFEST.json."""
    record = ShardRecord(ps_task=0, file="shard-00000-of-00001.pt", sha256="0" * 64, nbytes=1, global_step=0)
    manifest = Manifest(url="memory://x", step=0, num_shards=1, shards=(record,), created=0.0, format_version=1)
    written = manifest_to_json(manifest)
    keys = set(written) | {key for entry in written["shards"] for key in entry}
    return keys | {f.name for f in dataclasses.fields(Manifest)} | {f.name for f in dataclasses.fields(ShardRecord)}


def test_every_field_of_the_manifest_is_in_the_checkpoint_format_reference():
    fields = _manifest_fields()
    assert {"format_version", "step", "shards", "sha256", "nbytes", "url"} <= fields
    spans = _code_spans(_page("checkpoint-format.md"))
    missing = sorted(fields - spans)
    assert not missing, f"docs/reference/checkpoint-format.md does not name the manifest fields {missing} (as `name`)"


@pytest.mark.parametrize(
    "record", [shard.ShardData, shard.VariableData, shard.OptimizerData, shard.SyncData], ids=lambda c: c.__name__
)
def test_every_key_of_a_shard_file_is_in_the_checkpoint_format_reference(record):
    spans = _code_spans(_page("checkpoint-format.md"))
    missing = sorted(f.name for f in dataclasses.fields(record) if f.name not in spans)
    assert not missing, f"docs/reference/checkpoint-format.md does not name {record.__name__}'s keys {missing}"
