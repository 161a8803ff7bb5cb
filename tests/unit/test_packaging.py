"""setup.cfg declares the ranges psframe works with; constraints.txt pins the
exact set the scripts install, inside those ranges."""

from __future__ import annotations

import configparser
import re

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.conftest import ROOT

LOWER = {">=", ">", "~="}  # operators that bound a range from below
EXACT = {"==", "==="}


def _setup_cfg() -> configparser.ConfigParser:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    return config


def _lines(value: str) -> list[str]:
    return [line.strip() for line in value.splitlines() if line.strip()]


def _declared() -> dict[str, list[Requirement]]:
    """setup.cfg's requirements by where they are declared ("install_requires" or the extra's name)."""
    config = _setup_cfg()
    declared = {"install_requires": [Requirement(r) for r in _lines(config["options"]["install_requires"])]}
    for extra, value in config["options.extras_require"].items():
        declared[extra] = [Requirement(r) for r in _lines(value)]
    return declared


def _all_declared() -> list[tuple[str, Requirement]]:
    return [(where, req) for where, reqs in _declared().items() for req in reqs]


def _pins() -> dict[str, Version]:
    """constraints.txt as {canonical name: pinned version}."""
    pins: dict[str, Version] = {}
    for line in _lines((ROOT / "constraints.txt").read_text()):
        if line.startswith("#"):
            continue
        req = Requirement(line)
        specs = list(req.specifier)
        assert len(specs) == 1 and specs[0].operator == "==" and "*" not in specs[0].version, (
            f"constraints.txt: {line!r} is not an exact pin (name==version)"
        )
        name = canonicalize_name(req.name)
        assert name not in pins, f"constraints.txt pins {req.name} twice"
        pins[name] = Version(specs[0].version)
    return pins


def _requirement(name: str, where: str = "install_requires") -> Requirement:
    matches = [r for r in _declared()[where] if canonicalize_name(r.name) == name]
    assert len(matches) == 1, f"setup.cfg [{where}] declares {name} {len(matches)} times"
    return matches[0]


def test_setup_cfg_declares_the_runtime_requirements_and_the_extras():
    declared = _declared()
    names = {canonicalize_name(r.name) for r in declared["install_requires"]}
    assert names == {"torch", "grpcio", "protobuf", "numpy", "fsspec", "tqdm", "safetensors"}
    assert set(declared) == {
        "install_requires",
        "vision",
        "tensorboard",
        "bench",
        "disk",
        "stream",
        "broker",
        "test",
        "ray",
        "spark",
        "docs",
        "serve",
    }


@pytest.mark.parametrize("where, req", _all_declared(), ids=lambda x: str(x))
def test_every_requirement_is_a_range_with_a_lower_bound(where, req):
    operators = {spec.operator for spec in req.specifier}
    assert operators & LOWER, f"setup.cfg [{where}] {req}: no lower bound (>=, > or ~=)"
    assert not operators & EXACT, f"setup.cfg [{where}] {req}: an exact pin belongs in constraints.txt"


def test_torch_range_keeps_an_installed_torch_2_11_and_admits_the_pinned_one():
    torch = _requirement("torch")
    for version in ("2.11.0", "2.11.0+cu126", "2.13.0", "2.13.0+cpu"):
        assert torch.specifier.contains(version), f"setup.cfg {torch} refuses torch {version}"


def test_constraints_pin_torch_to_the_cpu_build_release():
    pins = _pins()
    assert pins["torch"] == Version("2.13.0")
    line = next(line for line in _lines((ROOT / "constraints.txt").read_text()) if line.startswith("torch=="))
    assert line == "torch==2.13.0", "a local label (+cpu) would not resolve from the package index"


@pytest.mark.parametrize("where, req", _all_declared(), ids=lambda x: str(x))
def test_every_declared_requirement_is_pinned_inside_its_range(where, req):
    pins = _pins()
    name = canonicalize_name(req.name)
    assert name in pins, f"setup.cfg [{where}] {req} has no pin in constraints.txt"
    assert req.specifier.contains(pins[name], prereleases=True), (
        f"constraints.txt pins {req.name}=={pins[name]}, outside setup.cfg [{where}] {req}"
    )


def test_grpcio_tools_is_pinned_with_the_grpcio_it_belongs_to():
    pins = _pins()
    assert pins["grpcio-tools"] == pins["grpcio"]


def _protobuf_gencode_version() -> Version:
    """The protobuf version that generated psframe_pb2.py, from its runtime check."""
    generated = sorted((ROOT / "psframe").rglob("psframe_pb2.py"))
    assert len(generated) == 1, f"expected one psframe_pb2.py under psframe/, found {generated}"
    text = generated[0].read_text()
    match = re.search(
        r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*"
        r"(\d+),\s*(\d+),\s*(\d+),",
        text,
    )
    assert match, "psframe_pb2.py has no ValidateProtobufRuntimeVersion(...) call to read"
    return Version(".".join(match.groups()))


def test_protobuf_range_is_what_the_generated_code_accepts():
    # The generated code refuses a runtime older than itself or of another major version.
    gencode = _protobuf_gencode_version()
    protobuf = _requirement("protobuf")
    lower = [Version(s.version) for s in protobuf.specifier if s.operator in LOWER]
    assert lower and min(lower) >= gencode, f"setup.cfg {protobuf} admits a runtime older than {gencode}"
    assert not protobuf.specifier.contains(f"{gencode.major + 1}.0.0"), (
        f"setup.cfg {protobuf} admits protobuf {gencode.major + 1}, which {gencode} gencode refuses"
    )
    assert protobuf.specifier.contains(_pins()["protobuf"])


def test_env_sh_installs_the_constraints_and_reinstalls_when_they_change():
    env_sh = (ROOT / "scripts" / "env.sh").read_text()
    assert '-c "$ROOT/constraints.txt"' in env_sh
    stamp = next(line for line in env_sh.splitlines() if line.startswith("want="))
    assert "setup.cfg" in stamp and "constraints.txt" in stamp, stamp
    assert "nvidia-" in env_sh  # still refuses CUDA wheels
