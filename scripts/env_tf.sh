#!/usr/bin/env bash
# Creates (once) the TensorFlow environment of the tf_ps benchmark baseline in
# .venv-tf: the bench extra's tensorflow-cpu requirement (setup.cfg) at the exact
# versions of constraints.txt, and nothing else: no torch, no psframe (the
# baseline, benchmarks/baselines/tf_ps.py, imports neither). The project's .venv,
# which the tests use, never gets TensorFlow. scripts/bench.sh runs this first;
# the benchmarks find the environment by itself (benchmarks/baselines/tf_env.py).
# A second run reuses it; it reinstalls only when setup.cfg or constraints.txt change.
#   ./scripts/env_tf.sh        (exit status 1, with pip's log, if it cannot be made)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-tf"
PYTHON_BIN="${PYTHON:-python3}"

# The one requirement, as the bench extra declares it (e.g. "tensorflow-cpu>=2.21").
requirement="$(sed -n '/^bench =/,/^[^ ]/p' "$ROOT/setup.cfg" | grep -o 'tensorflow-cpu[^ ]*' | head -n 1)"
if [ -z "$requirement" ]; then
    echo "[env-tf] setup.cfg's bench extra declares no tensorflow-cpu" >&2
    exit 1
fi

if [ ! -x "$VENV/bin/python" ]; then
    echo "[env-tf] creating $VENV" >&2
    "$PYTHON_BIN" -m venv "$VENV"
fi

stamp="$VENV/.psframe-tf-installed"
want="$(cd "$ROOT" && sha256sum setup.cfg constraints.txt | sha256sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
    echo "[env-tf] installing $requirement into $VENV (a few minutes the first time)" >&2
    if ! "$VENV/bin/pip" install --quiet --disable-pip-version-check \
            -c "$ROOT/constraints.txt" "$requirement" > "$VENV/pip-install.log" 2>&1; then
        cat "$VENV/pip-install.log" >&2
        echo "[env-tf] pip install failed (log above)" >&2
        exit 1
    fi
    # tensorflow-cpu pulls CUDA wheels only through its and-cuda extra, and never
    # torch: refuse an environment that has either all the same.
    unwanted="$("$VENV/bin/pip" list 2>/dev/null | grep -i -E '^(nvidia-|torch )' || true)"
    if [ -n "$unwanted" ]; then
        echo "[env-tf] refusing: these were installed: $unwanted" >&2
        exit 1
    fi
    if ! "$VENV/bin/python" -c "import tensorflow" > "$VENV/import-check.log" 2>&1; then
        tail -n 20 "$VENV/import-check.log" >&2
        echo "[env-tf] tensorflow does not import in $VENV (log above)" >&2
        exit 1
    fi
    echo "$want" > "$stamp"
fi
