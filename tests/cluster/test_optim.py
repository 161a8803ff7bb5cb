"""Unit tests for psframe.optim: optimizer specs by name and keyword arguments, checked up front.

This file holds the cluster tier's tests of the subject; `tests/unit/test_optim.py` holds the other
tiers'.
"""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.cluster
def test_checking_arguments_does_not_import_dynamo():
    # A worker checks its optimizer's arguments but never steps it: it should
    # not pay for torch._dynamo (a second and ~70 MB), which stepping imports.
    code = (
        "import sys, psframe\n"
        "for name in psframe.optim.SUPPORTED:\n"
        "    getattr(psframe.optim, name)(lr=0.5)\n"
        "try:\n"
        "    psframe.optim.SGD(lr=-1.0)\n"
        "except psframe.errors.OptimizerConfigError:\n"
        "    pass\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"
