#!/usr/bin/env bash
# Serving on the GPU machine, in one go: install (offline; pyzmq from carried wheels in .whl/),
# the GPU tests, the server/protocol/fuzz tests, `batchmaker demo` on cuda:0, and the issue-4
# runners over ZeroMQ (LSTM and TreeLSTM, fp16, h=1024). Results and this log land in $OUT.
#   OUT=/tmp/serving bash bench/gpu_serving.sh
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/serving}
mkdir -p "$OUT"
cd "$(dirname "$0")/.." || exit 1
exec > >(tee "$OUT/log.txt") 2>&1

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
    export PYTHONPATH=/tmp/site || exit 1
. bench/gpu_lib.sh
install || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import sys, torch, zmq; print(sys.version.split()[0], torch.__version__, 'pyzmq', zmq.__version__)"

marker=$(mktemp)
step gpu-tests timeout 200 python3 -m pytest -q -m gpu tests/ -p no:cacheprovider
step serving-tests timeout 200 python3 -m pytest -q tests/test_server.py tests/test_fuzz.py tests/test_protocol.py -p no:cacheprovider
step demo timeout 60 batchmaker demo --duration 10
Z="--device cuda:0 --mode zmq --dtype fp16 --duration 2 --min-requests 150 --warmup 300"
step wmt-lstm-zmq timeout 90 python3 bench/wmt.py --model lstm $Z --sweep 200:51200:2
step treebank-zmq timeout 90 python3 bench/treebank.py $Z --sweep 200:51200:2
find bench/results -maxdepth 1 -type f -newer "$marker" \( -name '*.json' -o -name '*.png' \) | tar -czf "$OUT/serving.tar.gz" -T -
tar -tzf "$OUT/serving.tar.gz"
