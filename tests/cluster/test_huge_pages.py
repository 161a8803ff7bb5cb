"""Large tensors of a ps task and of a worker's tables are advised onto transparent huge pages.

What the advice leaves is read from ``/proc/self/smaps``: the mapping that
holds a tensor says ``THPeligible: 1`` once it is advised (in the kernel's
``madvise`` mode, a mapping is eligible only then). Whether the kernel then
found free huge pages is its business, so no test counts them.

This file holds the cluster tier's tests of the subject; `tests/unit/test_huge_pages.py`,
`tests/service/test_huge_pages.py` hold the other tiers'.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from psframe.memory import huge_pages
from tests.unit.test_huge_pages import fresh_settings, needs_madvise_mode  # noqa: F401


@pytest.mark.cluster
@needs_madvise_mode
def test_opting_out_leaves_every_tensor_on_small_pages():
    code = (
        "import torch; from psframe.memory import huge_pages; from tests.unit.test_huge_pages import eligible, ROWS;"
        "t = huge_pages.full((ROWS, 64), 0.0, torch.float32); s = torch.ones(ROWS, 64); huge_pages.back([s]);"
        "print(huge_pages.enabled(), eligible(t), eligible(s))"
    )  # a fresh process: nothing advised before
    env_out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**__import__("os").environ, huge_pages.OPT_OUT_VARIABLE: "0"},
        check=True,
    )
    assert env_out.stdout.split() == ["False", "False", "False"]
