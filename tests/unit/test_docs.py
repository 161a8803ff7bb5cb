"""The docs: the site builds with warnings as errors, generated pages are current, the README's
quick start is the tested example, and the quick start runs as its page shows.

This file holds the unit tier's tests of the subject; `tests/cluster/test_docs.py` holds the other
tiers'.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess

from tests.conftest import ROOT

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
