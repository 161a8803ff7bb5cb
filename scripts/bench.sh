#!/usr/bin/env bash
# Runs the benchmark suite in the project's virtual environment (made on first
# use) and writes docs/benchmarks.md and docs/benchmarks.png.
#   ./scripts/bench.sh [--quick] [--skip training,memory,...] [--out docs/benchmarks.md]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
# One compute thread per process: every number is per core, on loopback.
export OMP_NUM_THREADS=1
exec python -m benchmarks.run "$@"
