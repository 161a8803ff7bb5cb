"""The examples use psframe's public surface only, and psframe.flags reads scripts' flags.

Users copy the examples, so whatever they import becomes API: they may use
the names of ``psframe`` and the public modules below, nothing under them.

This file holds the cluster tier's tests of the subject; `tests/unit/test_public_surface.py` holds
the other tiers'.
"""

from __future__ import annotations

import pytest

from tests.conftest import ROOT


@pytest.mark.cluster
@pytest.mark.parametrize("example", ["mlp_mnist_dist.py", "ctr_dist.py"])
def test_the_examples_show_their_flags(example):
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / example), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr
    for flag in ("--ps_hosts", "--job_name", "--auth_token_file", "--tls_ca_file"):
        assert flag in done.stdout
