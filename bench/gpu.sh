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
#     lstm     bench/wmt.py --model lstm, fp16 (every system, the bucket pick tuned) and fp32 (BatchMaker
#              vs bucketing), under bench/protocol.py: sustainable throughput, curves, 3 repeats
#     lstm16, lstm32  each half of it
#     seq2seq  bench/wmt.py --model seq2seq fp16: BatchMaker, bucketing, the request-level ablation
#     treebank bench/treebank.py on SST train trees (not the shipped sample), fp16: vs graph batching
#              (its tree cap tuned) and the ablation; the engine's cells per task tuned too (TREE_ENGINE_BATCHES)
#     serving  bench/wmt.py and bench/treebank.py over ZeroMQ (carry pyzmq wheels in .whl)
#     replicas-lstm, replicas-seq2seq, replicas-treebank (a multi-GPU machine): the engine as 1, 2 and 4
#              data-parallel replicas (those the machine has GPUs for) in one run, each N against 1
#              (issue 31: >= 1.8x at 2, >= 3.4x at 4); fp16; ~5-8 min each
#     baselines the baselines' tests on the GPU (graphs, fused tree cells, batches in flight)
#     decoders the decoder tests (HF references, Triton attention, CUDA-graph decode), bench/attention.py,
#              and a small bench/chat.py (tiny model) that checks the script end to end
#     chat     bench/chat.py: Llama-2-7B-sized random bf16, BatchMaker vs HF continuous and static batching
#     families issue 33: bench/chat.py on each family-sized random bf16 preset (FAMILIES, default qwen2.5-7b
#              mistral-7b phi-3-mini gemma-2-9b; llama-3-8b too where time allows), BatchMaker only,
#              FAMILY_REQUESTS (128) all at once after 16 warm-up ones: `roofline_fraction` at saturation and the
#              batch-1 step against its weight floor (`decode_steps`); each step ~1.5-2 min (build, engine start,
#              the run; estimated, not run yet), limited to 130 s (Phi-3-mini 110, Gemma-2-9B 170; FAMILY_TIMEOUT
#              sets all): the four fit one device command
#     http     issue 32 (carry pyzmq in .whl: install() installs .whl/*.whl): a Llama-2-7B-sized random bf16
#              checkpoint with the tiny tokenizer (bench/tiny_checkpoint.py DIR llama-2-7b), then
#              bench/http_overhead.py over it: HTTP against ZeroMQ per streamed token at 1, 64, 256 streams,
#              the load from 4 processes of its own, through the openai client where .whl/openai holds its
#              wheels (pydantic, httpx, anyio, typing_extensions...: ahead of the machine's own on the path)
#     http-ab  issue 32's before/after (the nineteenth session's HTTP streaming; not run yet, ~8 min
#              estimated): the same over two servers side by side, this tree's and the one in
#              .whl/http-base.tar (`git archive <commit> batchmaker > .whl/http-base.tar`; carry .whl), at
#              2048 KV blocks each (two 7B servers on one 80 GB GPU), ZeroMQ token ids and HTTP only;
#              HTTP_AB_CONCURRENCY (default "64 256") sets the stream counts
#     prefix   bench/chat.py --stateful (issue 32): the chat workload sent statelessly with automatic prefix
#              caching (GPU blocks + host tier) against stateless and the explicit conversations; ~5 min
#     verify18: the eighteenth session's GPU code not yet run (one GPU, ~7 min expected): the offloading GPU
#              tests (now with the CPU attention's), then the families Qwen2.5-7B, Gemma-2-9B (both ran every
#              iteration eagerly on 2026-11-26 before the capture retry and the sampling headroom) and Mistral-7B
#     long-splits  issue 33: split-KV decode at 4K-32K in 2-32 slices, and the automatic plan (~1 min)
#     gemv-squares  issue 33: the norm from the producing projection's partial sums of squares: its GPU tests, the
#              32-layer chain against today's (bench/gemv.py --sweep none), the graphed batch-1 step with it
#              (OneTokenConfig.norm_squares) and q | k | v's and gate | up's registers capped (not run yet, ~5 min)
#     chat-ab  "nothing slower": bench/chat_ab.sh, the chat workload over .whl/chat-base.tar's tree and this one (~5 min)
#     row-tests, row-ab, row-long, row-step  issue 33's one-row decode loop (kernels/triton_decode_row.py, for G = 1):
#              its GPU tests with paged attention's and the variants' (over 4 min on a fresh H100: 240 s cut it at 57);
#              bench/attention.py over batches 1-16 x 360-32K positions with ROW_TILES (BLOCK_N:WARPS[:MERGE_MAX],
#              default off 32:4 16:4 32:8 32:4:32) in turn (~5 min); the long shapes that missed 0.95 at 8-64 slices (wave fill: the row loop holds
#              3 programs an SM at 4 warps of 144 registers), short ones at 1-8 (~4 min); generation
#              against HF (with partial rotary and longrope's bf16 test) and the graphed batch-1 step with each
#              tile (~4 min); row-verify: the rule's GPU tests, generation, the A/B at its edges and the step (~6 min on
#              a fresh H200); row-splits: the loop in 4-24 slices at batch 1-2's short bounds (not run yet, ~1 min)
#     gemv-table  issue 33: a preset's GEMV tiles (TABLE_PRESET, default qwen2.5-7b, whose shapes are in no table):
#              bench/gemv.py --sweep prefetch --head, then bench/one_token_ab.py with the sweep's bests as a form (not
#              run yet; the Llama-2-7B sweeps took ~3-4 min each)
#     attention-long issue 33 (not run yet; ~3-5 min estimated): decode at 8K-32K positions, batches 1-8, split 8-128
#              ways (bench/attention.py --long-sweep): the slices past MAX_SPLITS that batches 1-4 may need for
#              >= 0.95 of the read bandwidth (0.90-0.94 with 8 programs an SM on an H100, 2026-11-26)
#     verify19: the nineteenth session's GPU code not yet run (one GPU, ~6 min expected): the one-token chain with
#              q | k | v biases (tests/test_gemv.py), sampling in chunks and the KV headroom, the routes' settings;
#              then Qwen2.5-7B's chat (its batch-1 step now on the one-token chain: 1.23x its floor through cuBLAS
#              on 2026-11-26) and the graphed batch-1 step of Llama-2-7B, Qwen2.5-7B and Mistral-7B against their
#              floors at the bandwidth measured in the same process (bench/decode_profile.py)
#     verify16: the GPU tests of code written without a GPU in the sixteenth session (the 4-bit
#              kernels, head sizes, windows and soft caps, Gemma 2, offloading, the one-shot
#              all-reduce's int64 flags and self-test)
#     offload  issue 34 on one GPU (~8 min on an H100, estimated: not run yet): the offloading GPU tests
#              (tests/test_offload_gpu.py, tests/test_compress4.py), then bench/offload.py: a 13B-sized
#              random bf16 model, offload=auto under 12 GiB at 8 and 64 prompts of 512 + 32 tokens, a
#              hand-picked policy, 4-bit weights; then, in a process of its own, the Accelerate anchor
#              (.probes/offload_probe.py: copy ../shared/probes there; skipped with a message where
#              missing) added to the same JSON; PROBE_NEW (default 32) sets the anchor's new tokens;
#              offload-tests, offload-bench, offload-anchor: each part alone. The default lets the search pick
#              how a host cache is attended in decode steps (on the GPU after a move, or on the CPU where it
#              lives: Placement.cpu_attention, printed in the policy line); `offload-attention` is the A/B
#              (not run yet; ~3-4 min estimated from the 2026-11-26 B=64 block of 35 s): bench/offload.py at 64
#              prompts, the chosen policy then the same with the attention the other way (--flip-attention),
#              each against its prediction, into offload-attention-*.json; by hand, --cpu-attention on|off forces
#              the search's option and --other GBSxNB:weights+cache+cpu_attention names one
#     offload-cap-ours, offload-cap-anchor  issue 34's headline as the issue states it (not run yet), two
#              device commands: both systems under one process-wide cap of 16 GiB (set_per_process_memory_fraction),
#              13B bf16, prompt 512, new 32. -ours: bench/offload.py --gpu-cap 16: the search's best block (at most
#              256 prompts) with the executor's own count of the GPU, then its block-size curve at 1 and 2 GPU
#              batches, then the 2026-11-26 run's choice again (3x64, 21 of 40 layers resident: --other), which the
#              search with the per-unit terms no longer picks (it predicts 32x4, 10 layers resident, ~52 s a block,
#              where that run's curve at 1, 4, 16 batches of 32 would ask for 512 prompts' host cache: 1.8x the
#              host). Estimated from that run's times: model 28 s, executor ~10 s a weight share (two), the rates
#              ~5 s, the chosen block ~55-70 s, the curve ~45 s, 3x64 ~150 s (it took 156): ~5-5.5 min of 400 s. -anchor: Accelerate at batches 16 24 32,
#              each in its own capped process (bench/capped_probe.py) with the weight budget the cap leaves beside
#              its KV cache, stopping at the first out of memory (~115-140 s a batch from the earlier anchor's
#              63 s generations and ~30 s start-up: ~6.5 min of its 570 s); it writes our best over Accelerate's
#              best into the same offload-cap JSON. `offload-cap` is the two in one command (~11 min: over one
#              device command's 10; run the halves). CAP_ANCHOR_BATCHES sets the anchor's batches
#     offload-4bit issue 34: bench/offload.py under the 16 GiB cap, the search's bf16 policy (at most 256 prompts), then
#              its policy for 4-bit weights and KV cache (--compress both), into offload-cap-4bit-*.json; then one prompt,
#              bf16 and 4-bit weights, each decode step against its weight floor (offload-cap-4bit-b1-*; ~6-7 min in all)
#     gemv-sweep issue 33: bench/gemv.py's sweep of the batch-1 GEMV tiles on this device (CONFIGS are the H200's; on an
#              H100 the GEMVs streamed 0.92 of the copy bandwidth, 2026-11-27), then the chained layer with and without PDL
#     read-bound issue 33: bench/read_bound.py: a read-only kernel's bandwidth at 32 MB-2 GB, over a 7B's 128 weight
#              matrices one launch each, and a dependent launch's time in a graph (the bounds under the batch-1
#              step and short decode attention; ~2 min)
#     ncu-step issue 33: Nsight Compute on the engine's batch-1 step (bench/decode_profile.py --attend engine
#              --eager-only: layer 1 of the third eager step, its six kernels) and on the read-only kernel over the same
#              four matrices (bench/read_bound.py --eager-only): time, DRAM throughput, occupancy, warp stalls (~2 min)
#     gemv4    issue 34: the 4-bit few-row projection (kernels/triton_gemv4.py): its GPU tests and those of the resident
#              4-bit layers, then bench/gemv4.py's tile sweep on 13B's projections at 1-16 rows (~6-8 min)
#     offload-70b-ours, offload-70b-anchor issue 34: a Llama-2-70B-sized model (138 GB bf16) on one GPU under a cap of
#              CAP_70B (72) GiB beside a host of 128 GiB: ours with only the streamed layers on the host (--streamed-only,
#              automatic), then Accelerate in a process of its own (bench/accelerate_offload.py: the shared probe
#              would build all 138 GB on the host first) at CAP_ANCHOR_BATCHES (64); one device command each
#     fdpp     split-KV decode with FlashDecoding++'s unified maximum (issue 33; written without a GPU):
#              its GPU tests (tests/test_unified_max.py), then bench/attention.py --unified-max (exact
#              against unified decode, batches 1-256 x contexts 256-32K); fdpp-tests, fdpp-ab: each half
#     skinny-route issue 33 (written without a GPU): the few-token projections' GPU tests (skinny kernel, FlashDecoding++'s
#              flat GEMM, the start-up router: tests/test_skinny.py, test_flat_gemm.py, test_skinny_routes.py), then
#              bench/skinny.py --route over SKINNY_PRESETS (default llama-2-7b qwen2.5-7b mistral-7b phi-3-mini
#              gemma-2-9b: 18 shapes x rows 8-64, 26 configs each): the router's pick against the exhaustive sweep
#              (`router_over_best`), into skinny-route-*.json; ~4-5 min on an H100 (estimated from ~90 kernel compiles
#              and ~2,500 graph timings; not run yet)
#     tp-tests, tp-step, tp-chat (a multi-GPU machine; issue 31): the tensor-parallel GPU tests; the
#              plain-PyTorch anchor (.probes/tp_probe.py: copy ../shared/probes there and carry it)
#              then bench/tp_step.py at TP 1 and $TP; bench/chat.py all at once at TP 1 and $TP
#     pp (a 2-GPU machine; issue 31): pp-tests then pp-chat: the pipeline-parallel GPU tests
#              (tests/test_pipeline_parallel_gpu.py), then bench/chat.py at PP 1 and 2, 768 requests offered
#              at 32/s (PP_RATES, PP_REQUESTS), above both's capacity: the row's `window` is the tokens/s at
#              saturation (13B: the issue's PP=2 >= 1.7x one GPU's); all at once (rate inf), the drain of
#              the last long requests, alone on the GPU, took half of PP=2's iterations (2026-11-26)
#     pp-step  bench/tp_step.py --pp 1 2: a pipeline's decode round at batch 1 and 64
#     tppp (a 4-GPU machine; issue 31): tppp-tests then tppp-chat: tensor and pipeline parallelism
#              together, TP=2 x PP=2 (tests/test_tensor_pipeline_gpu.py: bf16 tokens against one GPU, a
#              killed rank), then bench/chat.py all at once at TP=2 x PP=2 (13B); run on 4 H200s 2026-11-26
# Knobs: DURATION (s per point, default 0.5), WARM (0.15), REPEATS (3), RATES_LSTM,
# RATES_S2S, RATES_TREE (the curves' offered rates), RATES_REPLICAS_LSTM, RATES_REPLICAS_S2S,
# RATES_REPLICAS_TREE (the replica suites'), REPLICA_COUNTS (theirs: 1, 2, 4 up to the GPUs here),
# REPLICAS_SUBMIT (bulk, many or each: bench/runner.py's --submit for the replica suites; not bulk: the
# JSON's tag says which), HTTP_CONCURRENCY and HTTP_PROCESSES (the http suite's streams, 1 64 256, and
# client processes, 8: at 256 streams 4 openai clients fell behind on an H200), PREFIX_RATES and
# PREFIX_SECONDS (the prefix suite's conversations/s, comma-separated: 6 or 22,30; and seconds of arrivals, 45), SWEEP_*
# (START:STOP:FACTOR, gpu_engine suites).
# Exit status: the number of failed steps (0: all passed). New results (JSON, PNG) go to
# $OUT/results.tar.gz and the log to $OUT/log.txt; the steps' commands are in the log and each JSON.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu}
mkdir -p "$OUT"
cd "$(dirname "$0")/.." || exit 1
exec > >(tee "$OUT/log.txt") 2>&1
. bench/gpu_lib.sh
. bench/gpu_attention.sh

TREES=${TREES:-../shared/data/sst/train.txt}  # SST's train split: not the sample the project ships
[ -f "$TREES" ] || TREES=.gpu_data/train.txt  # on the GPU machine: carried there (../shared does not travel)
marker=$(mktemp)
step environment bash -c 'nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv;
    python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name(0))"; nproc'
step install install
step imports import_check
proto=(--device cuda:0 --duration "${DURATION:-0.5}" --warm "${WARM:-0.15}" --repeats "${REPEATS:-3}"
       --max-search-points 4 --warmup 1000 ${ENGINE_ARGS:-})
RATES_LSTM=${RATES_LSTM:-12000 17600 26000 38000 56000}
RATES_S2S=${RATES_S2S:-4000 5900 8700 12700 18700 27500}
RATES_TREE=${RATES_TREE:-6500 9500 14000 20500 30000 44000}
RATES_REPLICAS_LSTM=${RATES_REPLICAS_LSTM:-15000 30000 60000 120000 180000 240000}
RATES_REPLICAS_S2S=${RATES_REPLICAS_S2S:-8000 16000 32000 64000 96000 128000}
RATES_REPLICAS_TREE=${RATES_REPLICAS_TREE:-5000 10000 20000 40000 60000 80000}
GPUS=$(python3 -c 'import torch; print(",".join(f"cuda:{i}" for i in range(torch.cuda.device_count())))' 2>/dev/null)
REPLICA_COUNTS=${REPLICA_COUNTS:-$(python3 -c 'import torch; print(*[n for n in (1, 2, 4) if n <= torch.cuda.device_count()])' 2>/dev/null)}
REPLICAS_SUBMIT=${REPLICAS_SUBMIT:-bulk}  # how the generator hands bursts to the replicas: bulk (submit_burst), many, each
replicas=(--devices "$GPUS" --replicas $REPLICA_COUNTS --systems batchmaker null --submit "$REPLICAS_SUBMIT"
          --tag "replicas$([[ $REPLICAS_SUBMIT == bulk ]] || echo "-submit-$REPLICAS_SUBMIT")")
TP=${TP:-$(python3 -c 'import torch; print(max(1, torch.cuda.device_count()))' 2>/dev/null)}  # the tp suites' degree
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # (NVLink multicast off)
[[ " $* " == *" verify18 "* ]] && FAMILIES=${FAMILIES:-qwen2.5-7b gemma-2-9b mistral-7b}
[[ " $* " == *" verify19 "* ]] && FAMILIES=${FAMILIES:-qwen2.5-7b}
set -- $(for suite in "$@"; do case "$suite" in pp) echo pp-tests pp-chat ;; tppp) echo tppp-tests tppp-chat ;;
                                                  verify18) echo offload-tests families ;;
                                                  verify19) echo verify19-tests families batch1 ;;
                                                  *) echo "$suite" ;; esac; done)
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
        lstm16) step wmt-lstm-fp16 timeout 300 python3 bench/wmt.py --model lstm --dtype fp16 "${proto[@]}" --rates $RATES_LSTM --tune ;;
        lstm32) step wmt-lstm-fp32 timeout 150 python3 bench/wmt.py --model lstm --dtype fp32 "${proto[@]}" --rates $RATES_LSTM --systems batchmaker bucketing null ;;
        lstm) step wmt-lstm-fp16 timeout 160 python3 bench/wmt.py --model lstm --dtype fp16 "${proto[@]}" --rates $RATES_LSTM --tune
              step wmt-lstm-fp32 timeout 150 python3 bench/wmt.py --model lstm --dtype fp32 "${proto[@]}" --rates $RATES_LSTM --systems batchmaker bucketing null ;;
        seq2seq) step wmt-seq2seq-fp16 timeout 240 python3 bench/wmt.py --model seq2seq --dtype fp16 "${proto[@]}" --rates $RATES_S2S --systems batchmaker bucketing request-level null ;;
        treebank) step treebank-sst-fp16 timeout 220 python3 bench/treebank.py --dtype fp16 --trees "$TREES" "${proto[@]}" --rates $RATES_TREE --tune --tune-caps 256 512 \
                      --tune-engine-batches ${TREE_ENGINE_BATCHES:-512 1024 2048} ;;
        serving) step wmt-lstm-zmq timeout 200 python3 bench/wmt.py --model lstm --dtype fp16 --mode zmq "${proto[@]}" --rates $RATES_LSTM --systems batchmaker bucketing null
                 step treebank-zmq timeout 200 python3 bench/treebank.py --dtype fp16 --mode zmq --trees "$TREES" "${proto[@]}" --rates $RATES_TREE --systems batchmaker graph-batching null ;;
        replicas-lstm) step replicas-lstm timeout 590 python3 bench/wmt.py --model lstm --dtype fp16 "${proto[@]}" "${replicas[@]}" --rates $RATES_REPLICAS_LSTM ;;
        replicas-seq2seq) step replicas-seq2seq timeout 590 python3 bench/wmt.py --model seq2seq --dtype fp16 "${proto[@]}" "${replicas[@]}" --rates $RATES_REPLICAS_S2S ;;
        replicas-treebank) step replicas-treebank timeout 590 python3 bench/treebank.py --dtype fp16 --trees "$TREES" "${proto[@]}" "${replicas[@]}" --rates $RATES_REPLICAS_TREE ;;
        baselines) step baseline-tests timeout 60 python3 -m pytest -q -p no:cacheprovider -rf tests/test_baselines.py -k cuda ;;
        decoders) step decoder-tests timeout 400 python3 -m pytest -q -p no:cacheprovider -rf -s tests/test_generation_gpu.py tests/test_paged_attention.py tests/test_generation.py tests/test_decoder_models.py
                  step attention timeout 200 python3 bench/attention.py --out "bench/results/attention-$(device_name)-$(date +%F).json"
                  step chat-tiny timeout 200 python3 bench/chat.py --preset tiny-llama --requests 32 --rates 16,inf --hf-requests 8 --hf-rates inf --steps 1,4 ;;
        http) step http-checkpoint timeout 240 python3 bench/tiny_checkpoint.py /tmp/chat-llama-2-7b llama-2-7b
              client=(--client aiohttp)  # the openai client where its wheels came along (.whl/openai: bench/README.md)
              if compgen -G ".whl/openai/*.whl" > /dev/null && python3 -m pip install -q --no-index --no-deps \
                      --no-compile --target /tmp/site-openai .whl/openai/*.whl; then
                  export PYTHONPATH="$PYTHONPATH:/tmp/site-openai"; client=(--client openai)
              fi
              step http-overhead timeout 340 python3 bench/http_overhead.py --checkpoint /tmp/chat-llama-2-7b \
                  --devices cuda:0 --concurrency ${HTTP_CONCURRENCY:-1 64 256} --tokens 256 --num-blocks 4096 --tag llama-2-7b \
                  "${client[@]}" --processes ${HTTP_PROCESSES:-8} ;;
        http-ab) step http-checkpoint timeout 240 python3 bench/tiny_checkpoint.py /tmp/chat-llama-2-7b llama-2-7b
                 mkdir -p /tmp/http-base && tar -xf .whl/http-base.tar -C /tmp/http-base
                 client=(--client aiohttp)
                 if compgen -G ".whl/openai/*.whl" > /dev/null && python3 -m pip install -q --no-index --no-deps \
                         --no-compile --target /tmp/site-openai .whl/openai/*.whl; then
                     export PYTHONPATH="$PYTHONPATH:/tmp/site-openai"; client=(--client openai)
                 fi
                 step http-ab timeout 560 python3 bench/http_overhead.py --checkpoint /tmp/chat-llama-2-7b \
                     --devices cuda:0 --concurrency ${HTTP_AB_CONCURRENCY:-64 256} --tokens 256 --num-blocks 2048 \
                     --paths zmq-tokens http --base /tmp/http-base --tag llama-2-7b-ab "${client[@]}" --processes 4 ;;
        prefix) step prefix-chat timeout 570 python3 bench/chat.py --stateful --device cuda:0 --preset llama-2-7b --dtype bf16 \
                    --stateful-systems stateless gpu+cpu prefix+cpu --arrival-seconds ${PREFIX_SECONDS:-45} --warm-fraction 0.5 \
                    --conversation-rates "${PREFIX_RATES:-6}" --compress 10 --kv-gib 40 --host-gib 48 --tier-contexts '' ;;
        families) for preset in ${FAMILIES:-qwen2.5-7b mistral-7b phi-3-mini gemma-2-9b}; do
                case "$preset" in phi-3-mini) limit=110 ;; gemma-2-9b) limit=170 ;; *) limit=130 ;; esac  # (sum 540 s)
                step "families-$preset" timeout "${FAMILY_TIMEOUT:-$limit}" python3 bench/chat.py --device cuda:0 \
                    --preset "$preset" --dtype bf16 --systems batchmaker --rates inf --requests "${FAMILY_REQUESTS:-128}" \
                    --warm-up 16 --steps 1
            done ;;
        chat) step chat timeout 590 python3 bench/chat.py --device cuda:0 --preset llama-2-7b --dtype bf16 ${CHAT_ARGS:-} ;;
        tp-tests) step tp-tests timeout 400 python3 -m pytest -q -s -p no:cacheprovider tests/test_one_shot_gpu.py tests/test_tensor_parallel_gpu.py ;;
        tp-step)  # the anchor in the same command, then the engine's step (issue 31)
            step tp-probe timeout 200 python3 -m torch.distributed.run --nproc-per-node "$TP" .probes/tp_probe.py \
                --preset "${TP_PROBE_PRESET:-13b}" --batches 1,64 --ctx 512
            step tp-step timeout 590 python3 bench/tp_step.py --preset "${TP_PRESET:-llama-2-13b}" --tp ${TP_DEGREES:-1 $TP} \
                --batch 1 64 --context 512 --steps 32 ;;
        tp-chat) for tp in ${TP_DEGREES:-1 $TP}; do
                step "tp-chat-$tp" timeout 300 python3 bench/chat.py --preset "${TP_PRESET:-llama-2-13b}" \
                    --systems batchmaker --rates inf --requests 192 --warm-up 16 --steps "" --tensor-parallel "$tp"
            done ;;
        pp-tests) step pp-tests timeout 240 python3 -m pytest -q -s -p no:cacheprovider -rf tests/test_pipeline_parallel_gpu.py ;;
        pp-step) step pp-step timeout 590 python3 bench/tp_step.py --preset "${PP_PRESET:-llama-2-13b}" --tp --pp 1 2 \
                     --batch 1 64 --context 512 --steps 32 ;;
        pp-chat) for pp in 1 2; do
                step "pp-chat-$pp" timeout 240 python3 bench/chat.py --preset "${PP_PRESET:-llama-2-13b}" \
                    --systems batchmaker --rates "${PP_RATES:-32}" --requests "${PP_REQUESTS:-768}" --warm-up 16 --steps "" \
                    --pipeline-parallel "$pp"
            done ;;
        offload|offload-tests|offload-bench|offload-anchor)  # issue 34; `offload` is the three (their limits sum
            # to under the 10-minute command with the setup steps; expected ~8 min on an H100, not run yet)
            off=(--preset llama-2-13b --gpu-memory 12 --batches 8 64 --prompt 512 --new 32)
            [ "$suite" = offload-bench ] || [ "$suite" = offload-anchor ] ||
                step offload-tests timeout 115 python3 -m pytest -q -m gpu -p no:cacheprovider -rf \
                    tests/test_offload_gpu.py tests/test_compress4.py
            [ "$suite" = offload-tests ] || [ "$suite" = offload-anchor ] ||
                step offload-bench timeout 220 python3 bench/offload.py "${off[@]}"
            [ "$suite" = offload-tests ] || [ "$suite" = offload-bench ] ||
                step offload-anchor timeout 225 python3 bench/offload.py "${off[@]}" --anchor .probes/offload_probe.py \
                    --probe-new "${PROBE_NEW:-32}" --probe-timeout 215 ;;
        offload-attention)  # issue 34: the chosen B=64 policy, its host cache attended both ways (one process)
            step offload-attention timeout 400 python3 bench/offload.py --preset llama-2-13b --gpu-memory 12 \
                --batches 64 --prompt 512 --new 32 --flip-attention --other '' --no-compress --dequant-rows ;;
        offload-cap|offload-cap-ours|offload-cap-anchor)  # issue 34's headline under a 16 GiB cap (two commands)
            cap=(--preset llama-2-13b --gpu-cap 16 --prompt 512 --new 32)
            [ "$suite" = offload-cap-anchor ] ||
                step offload-cap-ours timeout 400 python3 bench/offload.py "${cap[@]}" --batches 256 --curve 1 2 \
                    --other 3x64:weights+cache+hidden@0.525 --no-compress --dequant-rows
            [ "$suite" = offload-cap-ours ] ||
                step offload-cap-anchor timeout 570 python3 bench/offload.py "${cap[@]}" --anchor .probes/offload_probe.py \
                    --anchor-batches ${CAP_ANCHOR_BATCHES:-16 24 32} --probe-timeout 180 ;;
        offload-4bit)  # issue 34: under the 16 GiB cap the search's bf16 policy, then its policy for 4-bit weights and KV
            # cache (--compress both); then at one prompt bf16 and 4-bit weights (all 40 layers' codes resident), each
            # step against its weight floor
            step offload-4bit timeout 330 python3 bench/offload.py --preset llama-2-13b --gpu-cap 16 --prompt 512 --new 32 \
                --batches 256 --other "" --compress both --dequant-rows --tag 4bit
            step offload-4bit-b1 timeout 200 python3 bench/offload.py --preset llama-2-13b --gpu-cap 16 --prompt 512 \
                --new 32 --batches 1 --other "" --compress weights --dequant-rows --tag 4bit-b1 ;;
        gemv4)  # issue 34: the 4-bit few-row projection's GPU tests, then its tiles swept on 13B's shapes (bench/gemv4.py)
            step gemv4-tests timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_gemv4.py \
                tests/test_offload_resident4.py tests/test_compress4.py tests/test_offload_gpu.py \
                tests/test_offload_serving_gpu.py
            step gemv4-sweep timeout 330 python3 bench/gemv4.py --out bench/results ;;
        offload-70b-ours|offload-70b-anchor)  # issue 34: 70B (138 GB) beside 128 GiB of host under a 72 GiB cap
            big=(--preset llama-2-70b --gpu-cap "${CAP_70B:-72}" --prompt 512 --new 32 --tag llama-2-70b)
            [ "$suite" = offload-70b-anchor ] ||
                step offload-70b-ours timeout 580 python3 bench/offload.py "${big[@]}" --batches "${BATCHES_70B:-64}" \
                    --other "" --no-compress --dequant-rows
            [ "$suite" = offload-70b-ours ] ||
                step offload-70b-anchor timeout 580 python3 bench/offload.py "${big[@]}" --anchor bench/accelerate_offload.py \
                    --probe-preset llama-2-70b --anchor-batches ${CAP_ANCHOR_BATCHES:-64} --probe-timeout 560 ;;
        fdpp|fdpp-tests|fdpp-ab)  # (the two steps fit one device command's 10 minutes together)
            [ "$suite" = fdpp-ab ] || step fdpp-tests timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rf \
                tests/test_unified_max.py
            [ "$suite" = fdpp-tests ] || step fdpp-ab timeout 320 python3 bench/attention.py --unified-max --out \
                "bench/results/attention-fdpp-$(device_name)-$(date +%F).json" ;;
        skinny-route) step skinny-route-tests timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rf \
                          tests/test_skinny.py tests/test_flat_gemm.py tests/test_skinny_routes.py
                      step skinny-route timeout 420 python3 bench/skinny.py --route \
                          --presets ${SKINNY_PRESETS:-llama-2-7b qwen2.5-7b mistral-7b phi-3-mini gemma-2-9b} ;;
        tppp-tests) step tppp-tests timeout 300 python3 -m pytest -q -s -p no:cacheprovider -rf tests/test_tensor_pipeline_gpu.py ;;
        tppp-chat) step tppp-chat timeout 300 python3 bench/chat.py --preset "${TPPP_PRESET:-llama-2-13b}" \
                       --systems batchmaker --rates inf --requests 192 --warm-up 16 --steps "" \
                       --tensor-parallel 2 --pipeline-parallel 2 ;;
        attention-long) step attention-long timeout 560 python3 bench/attention.py --long-sweep --out \
                            "bench/results/attention-long-$(device_name)-$(date +%F).json" ;;
        verify19-tests) step verify19-tests timeout 480 python3 -m pytest -q -m gpu -p no:cacheprovider -rf \
                            tests/test_gemv.py tests/test_sampling.py tests/test_skinny_routes.py tests/test_iteration_graphs.py ;;
        batch1)  # the graphed batch-1 (and 64) step against the weight floor at the bandwidth measured here
            bw=$(python3 -c 'import sys; sys.path.insert(0, "."); from bench.device_limits import measure; print(measure("cuda:0").copy_bytes_per_s)' 2>/dev/null || echo 3.0e12)
            for preset in ${BATCH1_PRESETS:-llama-2-7b qwen2.5-7b mistral-7b}; do
                step "batch1-$preset" timeout 150 python3 bench/decode_profile.py --preset "$preset" --batch 1 64 \
                    --context 360 --attend engine --bandwidth "$bw" \
                    --out "bench/results/decode-profile-$preset-$(device_name)-$(date +%F).json"
            done ;;
        ncu-step)  # issue 33: where the step's kernels wait (caches flushed before each kernel, clocks as they run)
            ncu_args=(--clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy
                      --section LaunchStats --section WarpStateStats --section SchedulerStats --section SourceCounters)
            # (a step launches 193 of these: 6 a layer and the head's; skip two steps and layer 0)
            step ncu-step timeout 300 ncu "${ncu_args[@]}" -k 'regex:gemv_kernel|paged_attention_kernel|combine_splits' \
                -s 392 -c 6 python3 bench/decode_profile.py --preset llama-2-7b --batch 1 --context 360 --attend engine \
                --eager-only
            step ncu-read timeout 120 ncu "${ncu_args[@]}" -k 'regex:^read$' -s 4 -c 4 python3 bench/read_bound.py \
                --eager-only ;;
        read-bound)  # issue 33: the least any kernel takes to read a decode step's weights and attention's KV sizes
            step read-bound timeout 300 python3 bench/read_bound.py --out \
                "bench/results/read-bound-$(device_name)-$(date +%F).json" ;;
        gemv-sweep)  # issue 33: the one-token GEMV's tiles on the device at hand (kernels/gemv.py CONFIGS came from an H200)
            step gemv-sweep timeout 400 python3 bench/gemv.py --out \
                "bench/results/gemv-$(device_name)-$(date +%F).json" ;;
        row-tests|row-ab|row-long|row-verify|row-splits|row-step|long-splits) attention_suite "$suite" ;;  # (gpu_attention.sh)
        gemv-table)  # a preset's one-token tiles on this device (TABLE_PRESET, default qwen2.5-7b: in no table yet): the
            # prefetch sweep of its projections and head, then its graphed step with the sweep's bests against CONFIGS
            preset=${TABLE_PRESET:-qwen2.5-7b}
            sweep="bench/results/gemv-prefetch-$preset-$(device_name)-$(date +%F).json"
            step "gemv-table-sweep-$preset" timeout 400 python3 bench/gemv.py --preset "$preset" --sweep prefetch --head \
                --out "$sweep"
            step "gemv-table-step-$preset" timeout 150 python3 bench/one_token_ab.py --preset "$preset" --forms configs \
                --gemv-configs "$sweep" --rounds 10 --out "${sweep/gemv-prefetch-/one-token-ab-}" ;;
        gemv-squares)  # issue 33: the producer-written norm (gemv.linear_residual + squares=): GPU tests, then the chains
            step gemv-squares-tests timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_gemv.py \
                -k "squares or one_token_forward"
            step gemv-squares timeout 120 python3 bench/gemv.py --sweep none --squares-maxnreg 0 128 144 --out \
                "bench/results/gemv-squares-$(device_name)-$(date +%F).json"
            step gemv-squares-step timeout 150 python3 bench/one_token_ab.py --forms configs --squares --rounds 10 \
                --override qkv,gate_up=8:1024:4:0:128 --out "bench/results/one-token-squares-$(device_name)-$(date +%F).json" ;;
        chat-ab) step chat-ab timeout 590 bash bench/chat_ab.sh ;;  # (.whl/chat-base.tar: bench/chat_ab.sh; ~3 rounds)
        verify16)  # the sixteenth session's code that no GPU has run yet (one lease of 2+ GPUs)
            step verify16-kernels timeout 500 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_compress4.py \
                tests/test_attention_head_sizes.py tests/test_attention_window_kernel.py tests/test_gemma_gpu.py \
                tests/test_offload_gpu.py -k "not variant"
            step verify16-one-shot timeout 300 python3 -m pytest -q -s -m gpu -p no:cacheprovider -rf tests/test_one_shot_gpu.py ;;
        *) echo "unknown suite $suite"; failed+=("$suite") ;;
    esac
done
# one archive: the device tool brings back at most 8 files
find bench/results -maxdepth 1 -type f -newer "$marker" \( -name '*.json' -o -name '*.png' \) | tar -czf "$OUT/results.tar.gz" -T -
echo "== results in $OUT/results.tar.gz:"; tar -tzf "$OUT/results.tar.gz"
echo "== failed steps: ${failed[*]:-none}"
exit "${#failed[@]}"
