#!/usr/bin/env bash
# The fused cell kernels on the GPU, in one go: install (offline), kernel tests, per-step bench
# (--sweep: also time each candidate block shape). Log, pytest report and results (JSON + PNG)
# land in $OUT (default /tmp/gpu_kernels).
#   bash bench/gpu_kernels.sh [--sweep]
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_kernels}
mkdir -p "$OUT"
cd "$(dirname "$0")/.." || exit 1
exec > >(tee "$OUT/log.txt") 2>&1

. bench/gpu_lib.sh

xdist() {  # compile kernels in several processes when pytest-xdist is there
    python3 -c "import xdist" 2>/dev/null && echo "-n 6 -p no:benchmark"
}

marker=$(mktemp)
step environment bash -c 'nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv;
    python3 -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__, torch.cuda.get_device_name(0))"'
step install install
# shellcheck disable=SC2046
step kernel-tests timeout 200 python3 -m pytest -q $(xdist) --junitxml="$OUT/pytest-kernels.xml" tests/test_kernels.py
step fused-cell timeout 330 python3 bench/fused_cell.py "$@"

find bench/results -maxdepth 1 -type f -newer "$marker" \( -name '*.json' -o -name '*.png' \) -exec cp {} "$OUT"/ \;
echo "== results in $OUT:"
ls -l "$OUT"
echo "== failed steps: ${failed[*]:-none}"
exit "${#failed[@]}"
