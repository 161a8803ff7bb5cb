"""The tf_ps baseline's wiring: found or reported unavailable, the inputs it is
given, its ratio in the training table, and (only where ``.venv-tf`` exists)
one quick run end to end.

The test environment has no TensorFlow (it lives in ``.venv-tf``, made by
``scripts/env_tf.sh``); the end-to-end test skips, saying so, without it.
No timing is asserted.

This file holds the cluster tier's tests of the subject; `tests/unit/test_benchmarks_tf.py` holds
the other tiers'.
"""

from __future__ import annotations

import pytest

from benchmarks.baselines import tf_env
from benchmarks.suite import training


@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_tf_ps_trains_end_to_end_where_its_environment_exists():
    reason = tf_env.unavailable_reason()
    if reason:
        pytest.skip(f"no TensorFlow here: {reason}")
    (row,) = training.run_training_benchmarks(["mnist_mlp"], quick=True, timeout=180, systems=["tf_ps"])
    assert "error" not in row and "unavailable" not in row, row
    assert row["global_steps_per_sec"] > 0 and row["processes"] == 3
    assert len(row["per_worker_steps_per_sec"]) == 2
    assert row["cpu_seconds"]["ps"] is not None  # the ps's CPU in the chief's window was measured
    assert 0 < row["final_loss"] < 10
