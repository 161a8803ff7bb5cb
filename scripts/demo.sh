#!/usr/bin/env bash
# Trains the MNIST MLP on a local cluster (1 ps + 2 workers by default),
# fetching MNIST first if needed. Extra arguments go to the example, e.g.
#   ./scripts/demo.sh --train_steps 3000
# NUM_PS / NUM_WORKERS choose the cluster's size.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

DATA_DIR="${DATA_DIR:-$ROOT/data}"
python scripts/fetch_mnist.py --data_dir "$DATA_DIR"
exec psframe launch --num_ps "${NUM_PS:-1}" --num_workers "${NUM_WORKERS:-2}" --timeout 1800 \
    examples/mlp_mnist_dist.py -- --data_dir "$DATA_DIR" "$@"
