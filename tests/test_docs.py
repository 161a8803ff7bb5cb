"""The docs: the site builds with warnings as errors, generated pages are current, the README's
quick start is the tested example, and the quick start runs as its page shows."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT, psframe_command

DOCS = ROOT / "docs"
README = ROOT / "README.md"
QUICKSTART = ROOT / "examples" / "quickstart.py"
README_MAX_LINES = 150
SUBPROCESS_TIMEOUT_S = 240

_spec = importlib.util.spec_from_file_location("cli_reference", ROOT / "scripts" / "cli_reference.py")
assert _spec is not None and _spec.loader is not None
cli_reference = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cli_reference)


def _section(path, name: str) -> str:
    """The lines of ``path`` between its ``--8<-- [start:name]`` and ``[end:name]`` markers."""
    text = path.read_text()
    match = re.search(rf"# --8<-- \[start:{name}\]\n(.*?)# --8<-- \[end:{name}\]", text, re.S)
    assert match, f"{path} has no section {name!r}"
    return match.group(1).strip()


@pytest.mark.cluster  # mkdocs' plugins start child processes
def test_the_site_builds_with_warnings_as_errors(tmp_path):
    try:
        from mkdocs.commands.build import build
        from mkdocs.config import load_config
    except ImportError:
        pytest.fail("mkdocs is not installed: install the docs extra (pip install -e '.[docs]'; scripts/test.sh does)")
    os.environ.setdefault("NO_MKDOCS_2_WARNING", "1")
    config = load_config(str(ROOT / "mkdocs.yml"), strict=True, site_dir=str(tmp_path / "site"))
    build(config)  # raises mkdocs' Abort on any warning: a broken link or anchor, a docstring griffe cannot read
    assert (tmp_path / "site" / "index.html").exists()
    assert (tmp_path / "site" / "reference" / "api" / "index.html").read_text().count("psframe.Trainer") > 0


def test_no_page_is_left_unwritten():
    unwritten = [str(p.relative_to(ROOT)) for p in DOCS.rglob("*.md") if "PAGE-NOT-WRITTEN-YET" in p.read_text()]
    assert not unwritten, unwritten


def test_the_command_line_reference_is_current():
    assert cli_reference.main(["--check"]) == 0, "docs/reference/cli.md is stale: run python scripts/cli_reference.py"


def test_the_command_line_reference_names_every_command_and_flag():
    page = (DOCS / "reference" / "cli.md").read_text()
    for command in ("server", "ping", "status", "shutdown", "launch"):
        assert f"### psframe {command}" in page
    for flag in ("--ps_hosts", "--job_name", "--checkpoint_dir", "--serving_processes", "--auth_token_file"):
        assert f"`{flag}`" in page


def test_the_readme_is_short_and_its_quick_start_is_the_tested_example():
    text = README.read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    assert _section(QUICKSTART, "quickstart") in text, "README's quick start differs from examples/quickstart.py"


def test_the_readme_links_point_at_files_that_exist():
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text())
    local = [link for link in links if "://" not in link and not link.startswith("mailto:")]
    assert local, "the README links into the docs"
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, missing


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        argv, cwd=ROOT, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S, env=env, check=False
    )


@pytest.mark.cluster
def test_the_quick_start_trains_alone():
    done = _run([sys.executable, str(QUICKSTART), "--train_steps", "200"])
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["global_step"] == 200 and result["loss"] < 0.1, result


@pytest.mark.cluster
def test_the_quick_start_trains_as_a_cluster_under_launch():
    done = _run(
        psframe_command("launch", "--num_ps", "2", "--num_workers", "2", "--timeout", "180")
        + [str(QUICKSTART), "--", "--train_steps", "200"]
    )
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    chief = [line for line in done.stdout.splitlines() if line.startswith("[worker0] {")]
    assert chief, done.stdout[-3000:]
    result = json.loads(chief[-1].removeprefix("[worker0] "))
    assert result["global_step"] >= 200 and result["loss"] < 0.5, result
    assert "[launch] done: ps0=0 ps1=0 worker0=0 worker1=0" in done.stdout
