# issue 33's decode-attention suites of bench/gpu.sh (sourced by it; `step`, `device_name` from gpu_lib.sh)

attention_suite() {  # attention_suite SUITE: one of the row-* and long-splits suites gpu.sh lists
    local suite=$1 name
    name=$(device_name)-$(date +%F)
    case "$suite" in
    row-tests)  # issue 33: the one-row decode loop (kernels/triton_decode_row.py) and the launches beside it
        step row-tests timeout 420 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_decode_row.py \
            tests/test_paged_attention.py tests/test_attention_variants.py ;;
    row-ab)  # the row loop's tiles against the tiled kernel ('off'), each shape's in turn, as the planner splits
        step row-ab timeout 340 python3 bench/attention.py --batches 1 2 4 16 --contexts 360 2048 8192 16384 32768 \
            --prefill 1:512 --row-tiles ${ROW_TILES:-off 32:4 16:4 32:8 32:4:32} --out \
            "bench/results/attention-row-ab-$(device_name)-$(date +%F).json"
        python3 bench/row_report.py bench/results/attention-row-ab-*-$(date +%F).json ;;
    row-long)  # the shapes under 0.95 of the read bandwidth: split counts x the tiled kernel's best and row tiles;
        # then batch-1/4 short contexts (the batch-1 step's), where up to 4 slices merge in the kernel
        step row-long timeout 300 python3 bench/attention.py --long-sweep --long-shapes 1:16384 1:32768 2:16384 \
            4:8192 --long-splits 8 12 16 24 32 64 --long-tiles 64:4:2 ${ROW_LONG_TILES:-row:32:4 row:16:4 row:32:8 row:32:4:64} --out \
            "bench/results/attention-row-long-$name.json"
        step row-short timeout 200 python3 bench/attention.py --long-sweep --long-shapes 1:360 1:512 4:360 1:2048 \
            --long-splits 1 2 4 8 --long-tiles 64:4:2 64:2:3 ${ROW_SHORT_TILES:-row:32:4 row:32:4:8 row:16:4:8 row:16:2:8} \
            --out "bench/results/attention-row-short-$name.json"
        python3 bench/row_report.py "bench/results/attention-row-long-$name.json" "bench/results/attention-row-short-$name.json" ;;
    row-verify)  # the row loop on by its rule (decode_row.row_splits): its GPU tests and the variants', bf16
        # generation against HF and serving's compiles, the A/B at batches 1-8 x 360-2K, the graphed batch-1 step
        # (ROW_VERIFY_GENERATION=0 skips generation: it passed with the rule's first form, H200 2026-11-27)
        step row-verify-tests timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_decode_row.py \
            tests/test_attention_variants.py
        [[ ${ROW_VERIFY_GENERATION:-1} == 1 ]] && step row-verify-generation timeout 250 python3 -m pytest -q -m gpu \
            -p no:cacheprovider -rf -s tests/test_generation_gpu.py -k "not fp32"
        step row-verify-ab timeout 60 python3 bench/attention.py --batches 1 2 4 8 --contexts 360 512 1024 2048 \
            --row-tiles off 32:4 --out "bench/results/attention-row-rule-$name.json"
        step row-verify-step timeout 60 python3 bench/one_token_ab.py --forms configs --row-tiles off 32:4 --rounds 10 \
            --out "bench/results/one-token-row-rule-$name.json"
        python3 bench/row_report.py "bench/results/attention-row-rule-$name.json" "bench/results/one-token-row-rule-$name.json" ;;
    row-splits)  # (not run yet, ~1 min) the row loop past its 8 slices at batch 1-2's short bounds: row_splits caps
        # them at SHORT_MAX_SPLITS (the tiled kernel's measure) and slices at 32 positions; more slices may pay here
        step row-splits timeout 150 python3 bench/attention.py --long-sweep --long-shapes 1:360 1:512 1:1024 1:2048 \
            2:360 2:512 --long-splits 4 8 12 16 24 --long-tiles 64:4:2 row:32:4 row:16:4 --out \
            "bench/results/attention-row-splits-$name.json"
        python3 bench/row_report.py "bench/results/attention-row-splits-$name.json" ;;
    row-step)  # generation against HF (bf16, the engine's graphs), then the graphed batch-1 step with the row
        # loop's tiles and without it, interleaved rounds
        step row-generation timeout 260 python3 -m pytest -q -m gpu -p no:cacheprovider -rf -s tests/test_generation_gpu.py \
            tests/test_rope_scaling.py  # (and Phi-3.5's RoPE: partial rotary, longrope, bf16 against transformers)
        step row-step timeout 240 python3 bench/one_token_ab.py --forms configs --row-tiles ${ROW_STEP_TILES:-off 32:4 32:4:8 16:4:8} \
            --rounds 10 --out \
            "bench/results/one-token-row-$(device_name)-$(date +%F).json"
        python3 bench/row_report.py bench/results/one-token-row-*-$(date +%F).json ;;
    long-splits)  # split-KV decode's slice counts at 4K-32K (tile 64:4:2; the H200 chose the rule, 2026-11-27), then
        # the automatic plan over batches 1-16, and the plot of both (attention_launch.pick_num_splits; ~1 min)
        step long-splits timeout 200 python3 bench/attention.py --long-sweep --long-shapes 1:4096 1:8192 1:16384 \
            1:32768 2:4096 2:16384 4:8192 8:16384 --long-splits 2 4 8 16 32 --long-tiles 64:4:2 --out \
            "bench/results/attention-long-splits-$name.json"
        step long-rule timeout 150 python3 bench/attention.py --batches 1 2 4 8 16 --contexts 4096 8192 16384 32768 \
            --prefill 1:512 --out "bench/results/attention-long-rule-$name.json"
        python3 bench/row_report.py "bench/results/attention-long-splits-$name.json" --splits-plot \
            "bench/results/attention-long-splits-$name.png" ;;
    esac
}
