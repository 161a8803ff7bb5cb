"""Imports point down the layers of DESIGN.md only: the folders are the layers.

This file holds the cluster tier's tests of the subject; `tests/unit/test_layers.py` holds the other
tiers'.
"""

from __future__ import annotations

import pytest

from tests.conftest import ROOT


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
