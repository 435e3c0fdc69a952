#!/usr/bin/env bash
# Issue 4, Seq2Seq on 1 and 2 GPUs of one machine (kind nvidia-h200-x2), engine only, one run:
# the target is the 2-GPU peak over our own 1-GPU peak. Results packed into $OUT/issue4-2gpu.tar.gz.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/issue4-2gpu}
mkdir -p "$OUT"
cd "$(dirname "$0")/.." || exit 1
exec > >(tee "$OUT/log.txt") 2>&1
marker=$(mktemp)
nvidia-smi --query-gpu=name --format=csv
python3 -m pip install --no-build-isolation --no-deps --no-index -q -e . ||
    python3 -m pip install --no-build-isolation --no-deps --no-index -q .
S="python3 bench/wmt.py --model seq2seq --dtype fp16 --systems batchmaker --duration 1.5 --min-requests 100 --warmup 200 --sweep 100:3200:2"
timeout 100 $S --device cuda:0 --tag 1gpu
timeout 100 $S --device cuda:0 --devices cuda:0,cuda:1
find bench/results -maxdepth 1 -type f -newer "$marker" \( -name '*.json' -o -name '*.png' \) | tar -czf "$OUT/issue4-2gpu.tar.gz" -T -
tar -tzf "$OUT/issue4-2gpu.tar.gz"
