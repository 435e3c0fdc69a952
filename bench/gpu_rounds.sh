#!/usr/bin/env bash
# Fused chain rounds on the GPU, in one go: their GPU tests (and the older CUDA engine, step-graph
# and kernel tests), the engine vs the GPU-bound limit with graphs on and off (LSTM h=1024 fp16
# B=512, WMT-like lengths and 2000-token chains), TreeLSTM on SST vs its cells' limit, and the WMT
# LSTM runner in process vs bucketing.
#   OUT=/tmp/rounds bash bench/gpu_rounds.sh
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/rounds}
mkdir -p "$OUT"
cd "$(dirname "$0")/.." || exit 1
exec > >(tee "$OUT/log.txt") 2>&1
. bench/gpu_lib.sh

marker=$(mktemp)
step install install
step gpu-tests timeout 300 python3 -m pytest -q -m gpu tests/test_chain_rounds.py tests/test_materialized.py tests/test_gpu.py tests/test_step_graphs.py -p no:cacheprovider
step gpu-engine timeout 200 python3 bench/gpu_engine.py --requests 8000 --graphs both --tag=-rounds
step gpu-engine-long timeout 200 python3 bench/gpu_engine.py --requests 1024 --warmup 512 --fixed-length 2000 \
  --graphs both --profile-requests 0 --tag=-rounds-long2000
step gpu-treelstm timeout 240 python3 bench/gpu_treelstm.py --trees 4000
if [ -z "$SKIP_WMT" ]; then
  step wmt-lstm timeout 150 python3 bench/wmt.py --device cuda:0 --dtype fp16 --duration 2 --min-requests 150 \
    --warmup 300 --model lstm --sweep 1600:204800:2 --tag rounds
fi
find bench/results -maxdepth 1 -type f -newer "$marker" \( -name '*.json' -o -name '*.png' \) | tar -czf "$OUT/rounds.tar.gz" -T -
tar -tzf "$OUT/rounds.tar.gz"
echo "== failed steps: ${failed[*]:-none}"
