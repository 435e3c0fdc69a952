#!/usr/bin/env bash
# The GPU runs, by suite, in one command (the device tool runs it on the GPU machine):
#   OUT=/tmp/gpu bash bench/gpu.sh SUITE [SUITE ...]
#     tests    the GPU tests (pytest -m gpu; the ZeroMQ ones skip where pyzmq is missing): all of
#              them took ~13 min on an H200 (2026-11-24), over one device command's 10; in parts:
#     tests-a  test files up to test_gemv.py (attention variants, conversations, fused decoder, gemv): ~4 min
#     tests-b  test_generation*.py to test_kernels.py (generation against HF, the engine, LSTM kernels): ~5 min
#     tests-c  the rest (paged attention, runners, skinny): ~3.5 min
#     kernels  the fused kernels' sweep tests and bench/fused_cell.py
#     engine   bench/gpu_engine.py: LSTM (WMT-like) and TreeLSTM (SST train) vs their cells' limit
#     profile  the same, smaller, with the manager thread under cProfile (where the host time goes)
#     rounds   the LSTM engine at 5, 8 and 12 steps per round (MaxTasksToSubmit)
#     lstm     bench/wmt.py --model lstm, fp16 and fp32: BatchMaker vs bucketing vs the null system
#     seq2seq  bench/wmt.py --model seq2seq fp16: the same
#     treebank bench/treebank.py on SST train trees (not the shipped sample), fp16: vs graph batching, null
#     serving  bench/wmt.py and bench/treebank.py over ZeroMQ (carry pyzmq wheels in .whl)
#     decoders the decoder tests (HF references, Triton attention, CUDA-graph decode), bench/attention.py,
#              and a small bench/chat.py (tiny model) that checks the script end to end
#     chat     bench/chat.py: Llama-2-7B-sized random bf16, BatchMaker vs HF continuous and static batching
# Knobs: DURATION (s per rate, default 2), SWEEP_LSTM, SWEEP_S2S, SWEEP_TREE (START:STOP:FACTOR).
# Exit status: the number of failed steps (0: all passed). New results (JSON, PNG) go to
# $OUT/results.tar.gz and the log to $OUT/log.txt; the steps' commands are in the log and each JSON.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu}
mkdir -p "$OUT"
cd "$(dirname "$0")/.." || exit 1
exec > >(tee "$OUT/log.txt") 2>&1
. bench/gpu_lib.sh

DURATION=${DURATION:-2}
TREES=${TREES:-../shared/data/sst/train.txt}  # SST's train split: not the sample the project ships
[ -f "$TREES" ] || TREES=.gpu_data/train.txt  # on the GPU machine: carried there (../shared does not travel)
marker=$(mktemp)
step environment bash -c 'nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv;
    python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name(0))"; nproc'
step install install
step imports import_check
common=(--device cuda:0 --duration "$DURATION" --min-requests 150 --warmup 300 ${ENGINE_ARGS:-})
for suite in "$@"; do
    case "$suite" in
        tests) step gpu-tests timeout 900 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/ ;;
        tests-a|tests-b|tests-c)  # (test files by name: up to test_gemv.py, to test_kernels.py, the rest)
            files=$(ls tests/test_*.py | awk -v part="${suite#tests-}" '
                {p = ($0 <= "tests/test_gemv.py") ? "a" : ($0 <= "tests/test_kernels.py") ? "b" : "c"} p == part')
            step "gpu-$suite" timeout 480 python3 -m pytest -q -m gpu -p no:cacheprovider -rf $files ;;
        kernels) step kernel-tests timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels.py
                 step fused-cell timeout 300 python3 bench/fused_cell.py ;;
        engine) step engine-lstm timeout 240 python3 bench/gpu_engine.py --model lstm --requests 40000
                step engine-treelstm timeout 240 python3 bench/gpu_engine.py --model treelstm --trees "$TREES" --requests 20000
                step engine-treelstm-b512 timeout 240 python3 bench/gpu_engine.py --model treelstm --trees "$TREES" --requests 20000 --max-batch 512 --tag b512 ;;
        rounds) for k in 5 8 12; do
                    step engine-lstm-k$k timeout 200 python3 bench/gpu_engine.py --model lstm --requests 40000 --round-steps $k --tag k$k
                done ;;
        profile) step profile-lstm timeout 240 python3 bench/gpu_engine.py --model lstm --requests 20000 --cprofile --tag cprofile
                 step profile-treelstm timeout 240 python3 bench/gpu_engine.py --model treelstm --trees "$TREES" --requests 10000 --cprofile --tag cprofile ;;
        lstm16) step wmt-lstm-fp16 timeout 280 python3 bench/wmt.py --model lstm --dtype fp16 "${common[@]}" --sweep "${SWEEP_LSTM:-6400:409600:2}" ;;
        lstm32) step wmt-lstm-fp32 timeout 280 python3 bench/wmt.py --model lstm --dtype fp32 "${common[@]}" --sweep "${SWEEP_LSTM:-6400:409600:2}" --systems batchmaker bucketing ;;
        lstm) step wmt-lstm-fp16 timeout 280 python3 bench/wmt.py --model lstm --dtype fp16 "${common[@]}" --sweep "${SWEEP_LSTM:-6400:409600:2}"
              step wmt-lstm-fp32 timeout 280 python3 bench/wmt.py --model lstm --dtype fp32 "${common[@]}" --sweep "${SWEEP_LSTM:-6400:409600:2}" --systems batchmaker bucketing ;;
        seq2seq) step wmt-seq2seq-fp16 timeout 300 python3 bench/wmt.py --model seq2seq --dtype fp16 "${common[@]}" --sweep "${SWEEP_S2S:-1600:204800:2}" ;;
        treebank) step treebank-sst-fp16 timeout 300 python3 bench/treebank.py --dtype fp16 --trees "$TREES" "${common[@]}" --sweep "${SWEEP_TREE:-800:102400:2}"
                  step treebank-sst-fp16-b512 timeout 300 python3 bench/treebank.py --dtype fp16 --trees "$TREES" "${common[@]}" --sweep "${SWEEP_TREE:-800:102400:2}" --engine-max-batch 512 --systems batchmaker graph-batching --tag engine-b512 ;;
        serving) step wmt-lstm-zmq timeout 280 python3 bench/wmt.py --model lstm --dtype fp16 --mode zmq "${common[@]}" --sweep 1600:102400:2
                 step treebank-zmq timeout 280 python3 bench/treebank.py --dtype fp16 --mode zmq --trees "$TREES" "${common[@]}" --sweep 800:51200:2 ;;
        decoders) step decoder-tests timeout 400 python3 -m pytest -q -p no:cacheprovider -rf -s tests/test_generation_gpu.py tests/test_paged_attention.py tests/test_generation.py tests/test_decoder_models.py
                  step attention timeout 200 python3 bench/attention.py --out "bench/results/attention-$(python3 -c 'import sys; sys.path.insert(0, "."); from bench.common import device_name; print(device_name("cuda:0"))')-$(date +%F).json"
                  step chat-tiny timeout 200 python3 bench/chat.py --preset tiny-llama --requests 32 --rates 16,inf --hf-requests 8 --hf-rates inf --steps 1,4 ;;
        chat) step chat timeout 590 python3 bench/chat.py --device cuda:0 --preset llama-2-7b --dtype bf16 ${CHAT_ARGS:-} ;;
        *) echo "unknown suite $suite"; failed+=("$suite") ;;
    esac
done
# one archive: the device tool brings back at most 8 files
find bench/results -maxdepth 1 -type f -newer "$marker" \( -name '*.json' -o -name '*.png' \) | tar -czf "$OUT/results.tar.gz" -T -
echo "== results in $OUT/results.tar.gz:"; tar -tzf "$OUT/results.tar.gz"
echo "== failed steps: ${failed[*]:-none}"
exit "${#failed[@]}"
