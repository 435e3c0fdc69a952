#!/usr/bin/env bash
# Materialized cells on the GPU, in one go: their tests (graphs == eager bit for bit, padding, pool
# growth, the switch), the CUDA engine tests, and TreeLSTM on SST vs the GPU-bound limit of its cells.
#   OUT=/tmp/materialized bash bench/gpu_materialized.sh
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/materialized}
mkdir -p "$OUT"
cd "$(dirname "$0")/.." || exit 1
exec > >(tee "$OUT/log.txt") 2>&1
. bench/gpu_lib.sh

marker=$(mktemp)
step install install
step gpu-tests timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_materialized.py tests/test_gpu.py
step gpu-treelstm timeout 240 python3 bench/gpu_treelstm.py --trees 4000
find bench/results -maxdepth 1 -type f -newer "$marker" \( -name '*.json' -o -name '*.png' \) | tar -czf "$OUT/materialized.tar.gz" -T -
tar -tzf "$OUT/materialized.tar.gz"
echo "== failed steps: ${failed[*]:-none}"
