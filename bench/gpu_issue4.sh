#!/usr/bin/env bash
# Issue 4 on the GPU, in one go: install (offline), then bench/wmt.py and bench/treebank.py at the
# paper's sizes (h=1024, vocab 30K; b_max 512 LSTM, 512/256 Seq2Seq, 64 TreeLSTM), each sweeping
# offered rates to saturation for every system. Steps run in priority order and are skipped once
# BUDGET_S seconds have passed. Results (JSON, PNG where matplotlib exists) and this log are packed
# into $OUT/issue4.tar.gz (the device tool returns at most 8 files).
#   OUT=/tmp/issue4 bash bench/gpu_issue4.sh
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/issue4}
BUDGET_S=${BUDGET_S:-470}
mkdir -p "$OUT"
cd "$(dirname "$0")/.." || exit 1
exec > >(tee "$OUT/log.txt") 2>&1

failed=()
step() {  # step NAME TIMEOUT COMMAND...: run unless the budget is spent; remember failures
    local name=$1 limit=$2 start=$SECONDS rc
    shift 2
    if [ "$SECONDS" -ge "$BUDGET_S" ]; then echo "== $name: skipped (budget spent)"; failed+=("$name:skipped"); return; fi
    echo "== $name: $*"
    timeout "$limit" "$@"
    rc=$?
    echo "== $name: rc=$rc in $((SECONDS - start)) s (total $SECONDS s)"
    [ "$rc" -eq 0 ] || failed+=("$name")
}

marker=$(mktemp)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name(0))"
python3 -c "import matplotlib; print('matplotlib', matplotlib.__version__)" || echo "matplotlib absent: PNGs drawn later"
python3 -m pip install --no-build-isolation --no-deps --no-index -q -e . ||
    python3 -m pip install --no-build-isolation --no-deps --no-index -q .

W="python3 bench/wmt.py --device cuda:0 --duration 2 --min-requests 150 --warmup 300"
T="python3 bench/treebank.py --device cuda:0 --duration 2 --min-requests 150 --warmup 300"
step smoke 60 $W --model lstm --hidden 64 --vocab 1000 --rates 200 --duration 0.5 --warmup 20 --tag smoke
step lstm-fp32 100 $W --model lstm --dtype fp32 --tf32 off --sweep 100:51200:2
step lstm-fp16 100 $W --model lstm --dtype fp16 --sweep 100:51200:2
step treelstm-fp16 90 $T --dtype fp16 --sweep 100:51200:2
step seq2seq-fp16 120 $W --model seq2seq --dtype fp16 --sweep 50:25600:2
step fixedtree-fp16 90 $T --dtype fp16 --trees fixed16 --systems batchmaker graph-batching ideal --sweep 100:51200:2
step treelstm-fp32 90 $T --dtype fp32 --tf32 off --sweep 100:51200:2
step lstm-fp16-all24 70 $W --model lstm --dtype fp16 --lengths all24 --sweep 200:51200:2 --duration 1.5
step lstm-fp16-max100 70 $W --model lstm --dtype fp16 --lengths max100 --sweep 200:51200:2 --duration 1.5
step lstm-fp16-max50 70 $W --model lstm --dtype fp16 --lengths max50 --sweep 200:51200:2 --duration 1.5

find bench/results -maxdepth 1 -type f -newer "$marker" \( -name '*.json' -o -name '*.png' \) | grep -v smoke |
    tar -czf "$OUT/issue4.tar.gz" -T -
tar -tzf "$OUT/issue4.tar.gz"
echo "== failed or skipped steps: ${failed[*]:-none}"
exit 0
