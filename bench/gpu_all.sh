#!/usr/bin/env bash
# Everything that needs the GPU, in one go: install (offline), GPU tests, completion bench, engine
# bench. Results (JSON + PNG), the pytest report and this log land in $OUT (default /tmp/gpu_all).
#   bash bench/gpu_all.sh
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_all}
mkdir -p "$OUT"
cd "$(dirname "$0")/.." || exit 1
exec > >(tee "$OUT/log.txt") 2>&1

. bench/gpu_lib.sh

marker=$(mktemp)
step environment bash -c 'nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv;
    python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name(0))"'
step install install
step imports import_check
step gpu-tests timeout 300 python3 -m pytest -q -m gpu --continue-on-collection-errors \
    --junitxml="$OUT/pytest-gpu.xml" tests/test_gpu.py tests/
step completion timeout 180 python3 bench/completion.py
step gpu-engine timeout 360 python3 bench/gpu_engine.py

find bench/results -maxdepth 1 -type f -newer "$marker" \( -name '*.json' -o -name '*.png' \) -exec cp {} "$OUT"/ \;
echo "== results in $OUT:"
ls -l "$OUT"
echo "== failed steps: ${failed[*]:-none}"
exit "${#failed[@]}"
