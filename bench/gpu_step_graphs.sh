#!/usr/bin/env bash
# k-step fused LSTM graphs (kernels/step_graphs.py) on the GPU, in one go: install (offline), the
# GPU tests, then the bench. Log, pytest report and results (JSON + PNG) land in $OUT
# (default /tmp/gpu_step_graphs).
#   bash bench/gpu_step_graphs.sh [--quick]
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_step_graphs}
mkdir -p "$OUT"
cd "$(dirname "$0")/.." || exit 1
exec > >(tee "$OUT/log.txt") 2>&1

. bench/gpu_lib.sh

marker=$(mktemp)
step environment bash -c 'nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader;
    python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name(0))"'
step install install
step tests timeout 150 python3 -m pytest -q -n 5 -p no:benchmark --junitxml="$OUT/pytest-step-graphs.xml" \
    tests/test_step_graphs.py
step bench timeout 120 python3 bench/step_graphs.py "$@"

find bench/results -maxdepth 1 -type f -newer "$marker" \( -name '*.json' -o -name '*.png' \) -exec cp {} "$OUT"/ \;
echo "== results in $OUT:"
ls -l "$OUT"
echo "== failed steps: ${failed[*]:-none}"
exit "${#failed[@]}"
