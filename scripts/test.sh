#!/usr/bin/env bash
# Runs the whole test suite in the project's virtual environment (made on first use):
# lint, format and types first (seconds), then the tests. --quick runs the unit and service
# tiers only (a few minutes; tests/conftest.py says what each tier holds); other arguments go
# to pytest.
set -euo pipefail
export PSFRAME_EXTRAS="${PSFRAME_EXTRAS-test,docs}"  # the tests, lint and types, and the docs build
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
# Settings of all three in pyproject.toml.
LINTED=(psframe tests benchmarks examples scripts)
ruff check --quiet "${LINTED[@]}"
ruff format --check --quiet "${LINTED[@]}"
mypy
# One compute thread per process: the suite runs many processes on few cores.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
ARGS=()
for arg in "$@"; do
    if [ "$arg" = --quick ]; then
        ARGS+=(-m "unit or service")
    else
        ARGS+=("$arg")
    fi
done
# The slowest tests at the end: the suite's budget (about 25 minutes on 2 cores) is kept by them.
exec python -m pytest -q -ra --durations=25 "${ARGS[@]}"
