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


# ---- the guides' signatures, tables and lists, against the code
#
# A guide writes a class or function's signature once, as the code reads it:
# ``psframe.SyncReplicas(replicas_to_aggregate=None, ..., async_tables=False)``.
# The tests find the call on the page that comes nearest (every argument, each
# default as the code has it), so an argument added to the code (an option, an
# optimizer's) fails here until the guide shows it.

GUIDES = ROOT / "docs" / "guides"


def _guide(name: str) -> str:
    path = GUIDES / name
    assert path.is_file(), f"{path.relative_to(ROOT)} is missing"
    return path.read_text()


def _calls(text: str, call: str) -> list[str]:
    """The argument lists (the text between the parentheses) of every ``call(...)`` written in ``text``."""
    found = []
    for match in re.finditer(rf"(?<![\w.]){re.escape(call)}\(", text):
        depth, quote = 1, ""
        for end in range(match.end(), len(text)):
            char = text[end]
            if quote:
                quote = "" if char == quote else quote
            elif char in "\"'":
                quote = char
            elif char in "([{":
                depth += 1
            elif char in ")]}":
                depth -= 1
                if not depth:
                    found.append(re.sub(r"#[^\n]*", "", text[match.end() : end]))  # comments of a code block
                    break
    return found


def _split_arguments(arguments: str) -> dict[str, str | None]:
    """``"a, b=1, *, c=(1, 2)"`` as ``{"a": None, "b": "1", "c": "(1, 2)"}`` (``*`` and ``**more`` left out)."""
    parts, depth, current = [], 0, ""
    for char in arguments:
        if char == "," and not depth:
            parts.append(current)
            current = ""
            continue
        depth += (char in "([{") - (char in ")]}")
        current += char
    parts.append(current)
    named: dict[str, str | None] = {}
    for part in (" ".join(p.split()) for p in parts):
        if not part or part.startswith("*"):
            continue
        name, _, default = part.partition("=")
        named[name.strip()] = default.strip() if default else None
    return named


def _value(written: str) -> object:
    """The value a default is written as: a literal, or arithmetic of numbers (``2**20``, ``16 << 20``)."""
    import ast
    import operator

    operators = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Pow: operator.pow}
    operators[ast.LShift] = operator.lshift

    def evaluate(node: ast.AST) -> object:
        if isinstance(node, ast.BinOp) and type(node.op) in operators:
            return operators[type(node.op)](evaluate(node.left), evaluate(node.right))
        return ast.literal_eval(node)

    return evaluate(ast.parse(written, mode="eval").body)


def signature_problems(page: str, call: str, function: object, defaults: bool = True) -> list[str]:
    """What the nearest ``call(...)`` on ``page`` gets wrong of ``function``'s parameters: those left
    out, and (with ``defaults``) each default written otherwise than the code has it. Empty: right."""
    import inspect

    parameters = [
        p
        for p in inspect.signature(function).parameters.values()  # type: ignore[arg-type]
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    best: list[str] | None = None
    for arguments in _calls(page, call):
        written, problems = _split_arguments(arguments), []
        for p in parameters:
            if p.name not in written:
                problems.append(f"{p.name} is missing")
                continue
            shown = written[p.name]
            if not defaults or p.default is p.empty or isinstance(p.default, type(dataclasses.MISSING)):
                continue
            try:
                same = shown is not None and _value(shown) == p.default
            except (ValueError, SyntaxError, TypeError):
                same = shown == repr(p.default)
            if not same:
                problems.append(f"{p.name}={shown} (the code: {p.default!r})")
        if best is None or len(problems) < len(best):
            best = problems
    return [f"{call}(...) is not written"] if best is None else best


def _signatures() -> list[tuple[str, str, object, bool]]:
    """(guide, call, what it calls, whether the defaults are written too), for each signature a guide shows."""
    import psframe

    optimizers = [
        ("trainer.md", f"psframe.optim.{name}", getattr(psframe.optim, name), True) for name in psframe.optim.SUPPORTED
    ]
    return [
        ("trainer.md", "psframe.Trainer", psframe.Trainer, True),
        *optimizers,
        ("trainer.md", "psframe.Placement", psframe.Placement, False),  # an example naming every argument
        ("trainer.md", "psframe.Transport", psframe.Transport, True),
        ("trainer.md", "psframe.Liveness", psframe.Liveness, True),
        ("sync.md", "psframe.SyncReplicas", psframe.SyncReplicas, True),
        ("sync.md", "psframe.BoundedStaleness", psframe.BoundedStaleness, True),
        ("checkpoints.md", "psframe.Checkpointing", psframe.Checkpointing, True),
        ("embedding-tables.md", "psframe.DynamicEmbedding", psframe.DynamicEmbedding, True),
        ("embedding-tables.md", "psframe.RowInitializer", psframe.RowInitializer, True),
        ("elastic.md", "psframe.DataRanges", psframe.DataRanges, True),
        ("security.md", "psframe.Security", psframe.Security, True),
    ]


@pytest.mark.parametrize(
    ("guide", "call", "function", "defaults"), [pytest.param(*s, id=f"{s[0]}:{s[1]}") for s in _signatures()]
)
def test_each_guide_signature_has_every_argument_of_the_code(guide, call, function, defaults):
    problems = signature_problems(_guide(guide), call, function, defaults)
    assert not problems, f"docs/guides/{guide}: {call}(...) differs from the code: {problems}"


def test_a_signature_left_behind_is_told_apart():
    def options(a, b=None, *, c=2**20, d="x", e=(), **more):
        pass

    page = "`f(a, b=None, *, c=1 << 20, d='x', e=())` and an example `f(1, c=3)`"
    assert signature_problems(page, "f", options) == []
    assert signature_problems("`f(a, b=None, c=2, d='x')`", "f", options) == ["c=2 (the code: 1048576)", "e is missing"]
    assert signature_problems("no call", "f", options) == ["f(...) is not written"]


def test_the_trainer_guide_has_a_row_for_every_argument_of_the_trainer():
    import inspect

    import psframe

    rows = set(re.findall(r"^\| `(\w+)` \|", _guide("trainer.md"), re.M))
    missing = [name for name in inspect.signature(psframe.Trainer).parameters if name not in rows]
    assert not missing, f"docs/guides/trainer.md's table of the constructor has no row for {missing}"


def test_the_guides_name_every_public_method_and_property_of_the_trainer():
    import psframe

    spans = " ".join(span for page in GUIDES.glob("*.md") for span in _code_spans(page.read_text()))
    public = [name for name in dir(psframe.Trainer) if not name.startswith("_")]
    assert {"step", "pull", "connect", "close"} <= set(public)
    missing = [name for name in public if not re.search(rf"\b{name}\b", spans)]
    assert not missing, f"no guide names the Trainer's {missing} (as code, e.g. `trainer.{missing[0]}`)"


def _own_flags(script: Path) -> list[str]:
    """The flags ``script`` adds itself (``parser.add_argument("--name", ...)``), read from its source."""
    import ast

    flags = []
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            flags += [a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")]
    return flags


def test_the_embedding_guide_lists_every_flag_of_the_ctr_example():
    flags = _own_flags(ROOT / "examples" / "ctr_dist.py")
    assert {"--train_steps", "--dynamic_tables", "--prefetch_rows"} <= set(flags)
    page = _guide("embedding-tables.md")
    table = page[page.index("examples/ctr_dist.py") :]
    rows = " ".join(line.split("|")[1] for line in table.splitlines() if line.startswith("| `--"))
    missing = [flag for flag in flags if not re.search(rf"`{re.escape(flag)}[`=]", rows)]
    assert not missing, f"docs/guides/embedding-tables.md's table of the CTR example's flags lacks {missing}"


def _api_entries() -> tuple[set[str], dict[str, list[str]]]:
    """What docs/reference/api.md renders: every ``::: name``, and the ``members`` a module entry is limited to."""
    import ast

    entries: set[str] = set()
    members: dict[str, list[str]] = {}
    current = ""
    for line in _page("api.md").splitlines():
        if line.startswith("::: "):
            current = line[4:].strip()
            entries.add(current)
        elif line.strip().startswith("members:") and current:
            members[current] = ast.literal_eval(line.split(":", 1)[1].strip())
    return entries, members


def test_the_api_reference_renders_every_name_of_psframe():
    import psframe

    entries, members = _api_entries()

    def rendered(name: str) -> bool:  # as psframe.NAME, or in the whole module that defines it
        where = getattr(getattr(psframe, name), "__module__", None)
        return f"psframe.{name}" in entries or (where in entries and where not in members)

    missing = [name for name in psframe.__all__ if name != "__version__" and not rendered(name)]
    assert not missing, f"docs/reference/api.md renders neither psframe.NAME nor the module of {missing}"


@pytest.mark.parametrize("module", ["psframe.checkpoint", "psframe.export"])
def test_the_api_reference_renders_every_public_name_of_a_module_it_lists_members_of(module):
    import importlib

    entries, members = _api_entries()
    assert module in entries, f"docs/reference/api.md has no ::: {module}"
    names = importlib.import_module(module).__all__
    missing = [name for name in names if module in members and name not in members[module]]
    assert not missing, f"docs/reference/api.md's members of {module} leave out {missing}, which its __all__ has"
