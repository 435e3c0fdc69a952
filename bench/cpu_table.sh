#!/usr/bin/env bash
# The CPU table of the README (h = 256, fp32) under bench/protocol.py, one command per workload:
#   bash bench/cpu_table.sh [lstm] [seq2seq] [treebank]      (default: all three; ~35 min on 2 cores)
# TREES: SST dev trees (default ../shared/data/sst/dev.txt). DyNet: pip install -e ".[dynet]".
set -o pipefail
cd "$(dirname "$0")/.." || exit 1
TREES=${TREES:-../shared/data/sst/dev.txt}
cpu=(--device cpu --hidden 256 --repeats 3 --max-search-points 4 --warmup 200)
for suite in "${@:-lstm seq2seq treebank}"; do
    for s in $suite; do
        case "$s" in
            lstm) python bench/wmt.py --model lstm "${cpu[@]}" --duration 3 --warm 1 --min-window-requests 1000 \
                      --rates 200 294 432 635 934 1373 --tune ;;
            seq2seq) python bench/wmt.py --model seq2seq "${cpu[@]}" --duration 8 --warm 2 --min-window-requests 150 \
                         --rates 8 12 18 26 38 --systems batchmaker bucketing request-level null ;;
            treebank) python bench/treebank.py "${cpu[@]}" --duration 3 --warm 1 --min-window-requests 1000 \
                          --trees "$TREES" --systems batchmaker graph-batching request-level dynet null \
                          --rates 150 220 330 480 700 1030 --tune --tune-caps 64 256 ;;
            *) echo "unknown suite $s"; exit 2 ;;
        esac
    done
done
