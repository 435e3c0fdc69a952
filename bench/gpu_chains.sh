#!/usr/bin/env bash
# Chain groups on the GPU, in one go: the CUDA engine tests, the engine vs the GPU-bound limit
# (LSTM h=1024 fp16 B=512), and the WMT runners in process (LSTM, Seq2Seq fp16) vs bucketing.
#   OUT=/tmp/chains bash bench/gpu_chains.sh
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/chains}
mkdir -p "$OUT"
cd "$(dirname "$0")/.." || exit 1
exec > >(tee "$OUT/log.txt") 2>&1
. bench/gpu_lib.sh

marker=$(mktemp)
step install install
step gpu-tests timeout 120 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider
step gpu-engine timeout 150 python3 bench/gpu_engine.py --requests 8000
W="python3 bench/wmt.py --device cuda:0 --dtype fp16 --duration 2 --min-requests 150 --warmup 300"
step wmt-lstm timeout 120 $W --model lstm --sweep 1600:102400:2 --tag chains
step wmt-seq2seq timeout 120 $W --model seq2seq --sweep 400:51200:2 --tag chains
find bench/results -maxdepth 1 -type f -newer "$marker" \( -name '*.json' -o -name '*.png' \) | tar -czf "$OUT/chains.tar.gz" -T -
tar -tzf "$OUT/chains.tar.gz"
echo "== failed steps: ${failed[*]:-none}"
