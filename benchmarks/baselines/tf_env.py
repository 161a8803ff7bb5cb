"""The TensorFlow environment of the ``tf_ps`` baseline, seen from the benchmarks' side.

TensorFlow runs in a virtual environment of its own, ``.venv-tf`` in the
repository, made by ``scripts/env_tf.sh`` (which ``scripts/bench.sh`` runs
first): the bench extra's ``tensorflow-cpu`` at the versions of
constraints.txt, and neither torch nor psframe. The test environment never has
it. :mod:`benchmarks.baselines.tf_ps` runs under that environment's python; the
parent (this side, with torch) writes the model's initial values and the data
for it with :func:`write_inputs`.

``PSFRAME_TF_PYTHON`` names another python to run it with; set to the empty
string, it turns the ``tf_ps`` system off (the tests do, to stay fast and
independent of whether ``.venv-tf`` exists). Where TensorFlow cannot run,
``tf_ps`` rows say why (:class:`benchmarks.suite.training_systems.SystemUnavailable`) and
the other systems still run.
"""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path

from benchmarks.common import ROOT
from benchmarks.mlp_workload import build_model, make_data

TF_PYTHON_VARIABLE = "PSFRAME_TF_PYTHON"
DEFAULT_VENV = ROOT / ".venv-tf"
# Importing TensorFlow takes about 5 s on one core; more on a loaded machine.
_CHECK_TIMEOUT_S = 120.0


def tf_python() -> str | None:
    """The python that runs the TF baseline: ``$PSFRAME_TF_PYTHON``, else ``.venv-tf``'s; None if turned off."""
    value = os.environ.get(TF_PYTHON_VARIABLE)
    if value is None:
        return str(DEFAULT_VENV / "bin" / "python")
    return value or None


@functools.cache
def _check(python: str | None) -> tuple[str | None, str | None]:
    """(TensorFlow's version, None) where ``python`` imports it, else (None, why not)."""
    if python is None:
        return None, f"turned off ({TF_PYTHON_VARIABLE} is set to the empty string)"
    if not os.access(python, os.X_OK):
        return None, (
            f"no TensorFlow environment ({python} does not exist): make it with "
            f"scripts/env_tf.sh, or set {TF_PYTHON_VARIABLE}"
        )
    try:
        proc = subprocess.run(
            [python, "-c", "import tensorflow as tf; print(tf.__version__)"],
            capture_output=True,
            text=True,
            timeout=_CHECK_TIMEOUT_S,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:  # subprocess.run kills it (by PID) first
        return None, f"{python} did not import tensorflow within {_CHECK_TIMEOUT_S:g}s"
    except OSError as e:
        return None, f"{python} does not run: {e}"
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return None, f"{python} cannot import tensorflow: {last}"
    return proc.stdout.strip().splitlines()[-1], None


def unavailable_reason() -> str | None:
    """Why the tf_ps system cannot run here, or None where it can (checked once per python)."""
    return _check(tf_python())[1]


def tf_version() -> str | None:
    """The TensorFlow version the tf_ps system runs with; None where it cannot run."""
    return _check(tf_python())[0]


def write_inputs(model: str, path: Path) -> Path:
    """Write ``model``'s initial values and the data set to ``path`` (``.npz``) for the TF tasks.

    The same numbers every torch system starts from
    (:func:`benchmarks.mlp_workload.build_model` and
    :func:`benchmarks.mlp_workload.make_data`): ``x`` (float32), ``y`` (int64),
    and each Linear's ``w<i>`` (torch's ``(out, in)`` layout) and ``b<i>``.
    """
    import numpy as np

    x, y = make_data()
    linears = [m for m in build_model(model) if hasattr(m, "weight")]
    arrays = {"x": x.numpy(), "y": y.numpy()}
    for i, layer in enumerate(linears):
        arrays[f"w{i}"] = layer.weight.detach().numpy()
        arrays[f"b{i}"] = layer.bias.detach().numpy()
    with open(path, "wb") as f:
        np.savez(f, **arrays)
    return Path(path)
