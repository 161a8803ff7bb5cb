#!/usr/bin/env bash
# Runs the benchmark suite in the project's virtual environment (made on first
# use) and writes docs/benchmarks.md and docs/benchmarks.png. The TensorFlow
# baseline's environment (.venv-tf) is made on first use too, unless
# PSFRAME_TF_PYTHON is set (a python of your own, or empty: no tf_ps); if it
# cannot be made, the tf_ps rows say so and everything else still runs.
#   ./scripts/bench.sh [--quick] [--skip training,memory,...] [--out docs/benchmarks.md]
set -euo pipefail
export PSFRAME_EXTRAS="${PSFRAME_EXTRAS-test}"  # matplotlib, psutil, trustme; TensorFlow lives in .venv-tf
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
if [ -z "${PSFRAME_TF_PYTHON+set}" ]; then
    "$ROOT/scripts/env_tf.sh" || echo "[bench] no TensorFlow environment: tf_ps will be reported unavailable" >&2
fi
# One compute thread per process: every number is per core, on loopback.
export OMP_NUM_THREADS=1
exec python -m benchmarks.run "$@"
