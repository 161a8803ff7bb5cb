"""The tf_ps baseline's wiring: found or reported unavailable, the inputs it is
given, its ratio in the training table, and (only where ``.venv-tf`` exists)
one quick run end to end.

The test environment has no TensorFlow (it lives in ``.venv-tf``, made by
``scripts/env_tf.sh``); the end-to-end test skips, saying so, without it.
No timing is asserted.

This file holds the unit tier's tests of the subject; `tests/cluster/test_benchmarks_tf.py` holds
the other tiers'.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from benchmarks import mlp_workload, report
from benchmarks.baselines import tf_env
from benchmarks.suite import scaling, scaling_tables, training, training_tables


@pytest.fixture
def tf_off(monkeypatch):
    monkeypatch.setenv(tf_env.TF_PYTHON_VARIABLE, "")


def test_an_empty_psframe_tf_python_turns_tf_ps_off(tf_off):
    assert tf_env.tf_python() is None
    assert "turned off" in tf_env.unavailable_reason()
    assert tf_env.tf_version() is None


def test_a_missing_environment_says_how_to_make_it(monkeypatch, tmp_path):
    monkeypatch.setenv(tf_env.TF_PYTHON_VARIABLE, str(tmp_path / "no-venv" / "bin" / "python"))
    reason = tf_env.unavailable_reason()
    assert "scripts/env_tf.sh" in reason and "no-venv" in reason


def test_without_tensorflow_the_rows_say_unavailable_and_nothing_fails(tf_off):
    rows = training.run_training_benchmarks(["mnist_mlp"], quick=True, timeout=60, repeats=2, systems=["tf_ps"])
    assert len(rows) == 1 and rows[0]["system"] == "tf_ps" and rows[0]["mode"] == "async"
    assert "error" not in rows[0] and "turned off" in rows[0]["unavailable"]
    assert math.isnan(rows[0]["global_steps_per_sec"])
    assert "n/a" in training_tables.format_table(rows)
    header, _, cells = training_tables.training_table(rows).splitlines()
    assert header.rstrip(" |").endswith("unavailable") and "turned off" in cells, header

    tf_ps = next(s for s in scaling.SYSTEMS if s.name == "tf_ps")
    rows = scaling.run_scaling_benchmarks(["mnist_mlp"], quick=True, timeout=60, workers=[1], systems=[tf_ps])
    assert [(r["system"], r["workers"]) for r in rows] == [("tf_ps", 1)]
    assert "error" not in rows[0] and "turned off" in rows[0]["unavailable"]
    header = scaling_tables.scaling_table(rows).splitlines()[0]
    assert header.rstrip(" |").endswith("note"), header  # not "error": nothing failed


def test_systems_are_picked_by_name():
    with pytest.raises(ValueError, match="unknown system"):
        training.run_training_benchmarks(["mnist_mlp"], quick=True, systems=["tensorflow"])


def test_the_inputs_are_the_torch_systems_numbers(tmp_path):
    path = tf_env.write_inputs("mnist_mlp", tmp_path / "inputs.npz")
    inputs = np.load(path)
    x, y = mlp_workload.make_data()
    np.testing.assert_array_equal(inputs["x"], x.numpy())
    np.testing.assert_array_equal(inputs["y"], y.numpy())
    model = mlp_workload.build_model("mnist_mlp")
    np.testing.assert_array_equal(inputs["w0"], model[0].weight.detach().numpy())  # torch's (out, in)
    np.testing.assert_array_equal(inputs["b1"], model[2].bias.detach().numpy())
    assert sorted(inputs.files) == ["b0", "b1", "w0", "w1", "x", "y"]


def test_psframe_rows_are_compared_with_tf_ps_in_the_same_mode():
    def row(system, mode, rate, runs):
        return {
            "system": system,
            "model": "large_mlp",
            "mode": mode,
            "global_steps_per_sec": rate,
            "samples_per_sec": 100.0 * rate,
            "steps": 10,
            "seconds": 1.0,
            "run_rates": runs,
        }

    rows = training_tables.training_ratios(
        [
            row("psframe", "async", 4.0, [4.0, 5.0, 3.0]),
            row("tf_ps", "async", 2.0, [2.0, 2.0, 3.0]),
            row("psframe", "sync", 2.0, [2.0, 2.0, 2.0]),
        ]
    )
    assert rows[0]["vs_tf_ps"] == pytest.approx(2.0)  # median of 2.0, 2.5 and 1.0, repeat by repeat
    assert rows[1]["vs_tf_ps"] == pytest.approx(1.0)
    assert rows[2]["vs_tf_ps"] is None  # TF runs async only
    assert "samples/s vs tf_ps" in training_tables.training_table(rows)
    assert "psframe's samples/s over tf_ps's (TensorFlow's parameter server): 2.00x" in (
        report.section_text("training", rows)
    )
    assert training_tables.training_summary(rows[1:]) == ""  # no psframe async row: nothing to say
