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

failed=()
step() {  # step NAME COMMAND...: run, time, and remember failures without stopping the rest
    local name=$1 start=$SECONDS rc
    shift
    echo "== $name: $*"
    "$@"
    rc=$?
    echo "== $name: rc=$rc in $((SECONDS - start)) s"
    [ "$rc" -eq 0 ] || failed+=("$name")
}

install() {
    python3 -m pip install --no-build-isolation --no-deps --no-index -q -e . ||
        python3 -m pip install --no-build-isolation --no-deps --no-index -q .
}

import_check() {  # every batchmaker module must import without pyzmq (the GPU box has none)
    python3 - <<'PY'
import importlib, pkgutil, sys
import batchmaker
try:
    import zmq  # noqa: F401
    print("pyzmq present")
except ImportError:
    print("pyzmq absent")
bad = []
for pkg in ("batchmaker", "batchmaker.cells", "batchmaker.unfolders", "batchmaker.kernels"):
    for m in pkgutil.iter_modules(importlib.import_module(pkg).__path__):
        try:
            importlib.import_module(f"{pkg}.{m.name}")
        except Exception as e:
            bad.append(f"{pkg}.{m.name}: {type(e).__name__}: {e}")
print("import failures:", bad or "none")
sys.exit(1 if bad else 0)
PY
}

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
