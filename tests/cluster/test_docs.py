"""The docs: the site builds with warnings as errors, generated pages are current, the README's
quick start is the tested example, and the quick start runs as its page shows.

This file holds the cluster tier's tests of the subject; `tests/unit/test_docs.py` holds the other
tiers'.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.conftest import ROOT, psframe_command
from tests.unit.test_docs import QUICKSTART, _run


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
