"""The examples use psframe's public surface only, and psframe.flags reads scripts' flags.

Users copy the examples, so whatever they import becomes API: they may use
the names of ``psframe`` and the public modules below, nothing under them.

This file holds the unit tier's tests of the subject; `tests/cluster/test_public_surface.py` holds
the other tiers'.
"""

from __future__ import annotations

import argparse
import ast
import json

import pytest

import psframe
from psframe import flags
from psframe.config.liveness import Liveness
from psframe.errors import ClusterSpecError, SecurityConfigError
from tests.conftest import ROOT

PUBLIC_MODULES = {
    "psframe",
    "psframe.flags",
    "psframe.optim",
    "psframe.hooks",
    "psframe.checkpoint",
    "psframe.export",
    "psframe.streams",
    "psframe.streams.local_broker",
    "psframe.errors",
    "psframe.spark",
    "psframe.ray",
    "psframe.k8s",
}
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def psframe_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """Every psframe name a module reaches for: its imports, and ``psframe.x.y`` attribute chains."""
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            uses += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "psframe"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "psframe":
            uses.append((node.lineno, node.module))
            if node.module == "psframe":
                uses += [(node.lineno, f"psframe.{a.name}") for a in node.names]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "psframe":
            uses.append((node.lineno, f"psframe.{node.attr}"))
    return uses


def is_public(name: str) -> bool:
    """A public module, or a name ``psframe`` exports."""
    if name in PUBLIC_MODULES:
        return True
    parent, _, attr = name.rpartition(".")
    return parent == "psframe" and attr in psframe.__all__


def test_there_are_examples():
    assert len(EXAMPLES) >= 4


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_use_only_the_public_surface(path):
    tree = ast.parse(path.read_text())
    internal = [f"{path.name}:{line}: {name}" for line, name in psframe_uses(tree) if not is_public(name)]
    assert not internal, f"examples may use {sorted(PUBLIC_MODULES)} and psframe.__all__ only:\n" + "\n".join(internal)


def test_the_check_sees_internal_imports():
    tree = ast.parse(
        "import psframe\nimport psframe.cli\nfrom psframe.cluster.tf_config import resolve_cluster\n"
        "from psframe import launch, flags\npsframe.worker.client.ping('h:1')\n"
    )
    bad = sorted(name for _, name in psframe_uses(tree) if not is_public(name))
    assert bad == ["psframe.cli", "psframe.cluster.tf_config", "psframe.launch", "psframe.worker"]


# ---- psframe.flags


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    flags.add_cluster_flags(parser)
    flags.add_security_flags(parser)
    flags.add_liveness_flags(parser)
    return parser


def test_the_cluster_comes_from_the_flags_or_tf_config():
    args = parser().parse_args(["--ps_hosts=h0:2222", "--worker_hosts=h1:2224,h1:2225", "--job_name=worker"])
    args.task_index = 1
    assert flags.cluster_from_flags(args, environ={}) == (
        psframe.ClusterSpec.from_string("ps|h0:2222,worker|h1:2224;h1:2225"),
        "worker",
        1,
    )
    tf_config = {
        "cluster": {"chief": ["h1:2224"], "ps": ["h0:2222"], "worker": ["h1:2225"]},
        "task": {"type": "chief", "index": 0},
    }
    cluster, job, index = flags.cluster_from_flags(
        parser().parse_args([]), environ={"TF_CONFIG": json.dumps(tf_config)}
    )
    assert (cluster.to_string(), job, index) == ("ps|h0:2222,worker|h1:2224;h1:2225", "worker", 0)
    with pytest.raises(ClusterSpecError, match="no cluster is defined"):
        flags.cluster_from_flags(parser().parse_args([]), environ={})


def test_security_and_liveness_come_from_the_flags_then_the_environment(token_file, tls_files, monkeypatch):
    token, path = token_file
    monkeypatch.setenv("PSFRAME_TLS_CA_FILE", tls_files.ca)
    monkeypatch.setenv("PSFRAME_KEEPALIVE_TIMEOUT", "7")
    args = parser().parse_args([f"--auth_token_file={path}", "--keepalive_time=3"])
    assert flags.security_from_flags(args) == psframe.Security(auth_token=token, tls_ca_file=tls_files.ca)
    assert flags.liveness_from_flags(args) == Liveness(keepalive_time=3.0, keepalive_timeout=7.0)
    with pytest.raises(SecurityConfigError, match="cannot read the auth token file"):
        flags.security_from_flags(parser().parse_args([f"--auth_token_file={path}.missing"]))


def test_a_staleness_bound_comes_from_its_flag():
    parser = argparse.ArgumentParser()
    flags.add_sync_flags(parser)
    assert flags.staleness_from_flags(parser.parse_args([])) is None
    assert flags.staleness_from_flags(parser.parse_args(["--staleness_bound=2", "--sync_timeout=30"])) == (
        psframe.BoundedStaleness(2, 30.0)
    )
    with pytest.raises(ValueError, match="give it or --sync_replicas, not both"):
        flags.staleness_from_flags(parser.parse_args(["--staleness_bound=2", "--sync_replicas"]))
    with pytest.raises(ValueError, match="steps must be an int >= 0, got -1"):
        flags.staleness_from_flags(parser.parse_args(["--staleness_bound=-1"]))


def test_sync_comes_from_tf_s_flags():
    parser = argparse.ArgumentParser()
    flags.add_sync_flags(parser)
    assert flags.sync_from_flags(parser.parse_args([])) is None
    assert flags.sync_from_flags(parser.parse_args(["--sync_replicas"])) == psframe.SyncReplicas(timeout=300.0)
    given = parser.parse_args(
        ["--sync_replicas", "--replicas_to_aggregate=2", "--total_num_replicas=3", "--sync_timeout=30"]
    )
    assert flags.sync_from_flags(given) == psframe.SyncReplicas(2, 3, 30.0)
    with pytest.raises(ValueError, match=r"replicas_to_aggregate \(3\) must be <= total_num_replicas \(2\)"):
        flags.sync_from_flags(
            parser.parse_args(["--sync_replicas", "--replicas_to_aggregate=3", "--total_num_replicas=2"])
        )


def test_flags_not_added_to_the_parser_are_named():
    bare = argparse.ArgumentParser().parse_args([])
    for read, adder in (
        (flags.cluster_from_flags, "add_cluster_flags"),
        (flags.security_from_flags, "add_security_flags"),
        (flags.liveness_from_flags, "add_liveness_flags"),
        (flags.sync_from_flags, "add_sync_flags"),
    ):
        with pytest.raises(TypeError, match=rf"have no --.*psframe\.flags\.{adder}\(parser\)"):
            read(bare)
