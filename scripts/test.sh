#!/usr/bin/env bash
# Runs the whole test suite in the project's virtual environment (made on first use).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
# One compute thread per process: the suite runs many processes on few cores.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec python -m pytest -q -ra "$@"
