"""The CTR example: embedding tables through a real cluster reach one process's AUC.

This file holds the unit tier's tests of the subject; `tests/cluster/test_ctr_example.py` holds the
other tiers'.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "examples"))

from ctr_data import auc, ceiling_auc, click_log

EXAMPLE = str(ROOT / "examples" / "ctr_dist.py")
STEPS = 1000  # samples: 1000 x 256 in every mode
# 400,000 samples: no worker sees one twice in 1,000 x 256, so no mode overfits (with 100,000
# the single process does, and its held-out AUC wanders by more than the tolerance).
COMMON = ["--batch_size=256", "--train_samples=400000", "--test_samples=30000", "--hash_buckets=65536"]
AUC_TOLERANCE = 0.005


def chief_result(output: str) -> dict:
    lines = [line.removeprefix("[worker0] ") for line in output.splitlines() if line.startswith("[worker0] {")]
    return json.loads(lines[-1])


@pytest.fixture(scope="module")
def reference() -> dict:
    """The example in one process with torch.optim (``--single_process``): the AUC to reach."""
    single = subprocess.run(
        [sys.executable, EXAMPLE, "--single_process", f"--train_steps={STEPS}", *COMMON],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        check=True,
    )
    return json.loads(single.stdout.strip().splitlines()[-1])


def test_auc_counts_pairs_ranked_right_and_ties_half():
    assert auc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1])) == 0.75
    assert auc(torch.tensor([1.0, 1.0, 2.0]), torch.tensor([1, 0, 1])) == 0.75  # a tie: half a pair


def test_the_planted_click_log_is_reproducible_and_has_a_known_ceiling():
    a, b = click_log(2000, buckets=1000, seed=3), click_log(2000, buckets=1000, seed=3)
    assert torch.equal(a.ids, b.ids) and torch.equal(a.clicks, b.clicks)
    assert (
        a.ids.shape == (2000, 26) and a.dense.shape == (2000, 13) and 0 <= int(a.ids.min()) <= int(a.ids.max()) < 1000
    )
    held_out = click_log(2000, buckets=1000, seed=3, split=1)
    assert not torch.equal(held_out.clicks, a.clicks)
    assert 0.85 < ceiling_auc(held_out) < 1.0 and 0.1 < float(a.clicks.mean()) < 0.5


def test_the_admission_and_ttl_flags_reach_the_dynamic_tables():
    import ctr_dist

    args = ctr_dist.parse_args(["--dynamic_tables", "--admit_after=3", "--row_ttl_seconds=90", "--max_rows_per_ps=50"])
    model = ctr_dist.build_model(args)
    for table in (model.wide, model.deep):
        spec = table.spec
        assert (spec.admission.min_count, spec.eviction.ttl_seconds, spec.eviction.max_rows) == (3, 90.0, 50)
    defaults = ctr_dist.build_model(ctr_dist.parse_args(["--dynamic_tables"])).deep.spec
    assert (defaults.admission.min_count, defaults.eviction.ttl_seconds) == (1, None)
