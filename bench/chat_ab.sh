#!/usr/bin/env bash
# "Nothing slower" on the chat workload: bench/chat.py (Llama-2-7B-sized random bf16, BatchMaker only) over a tree
# before a change and this one, in turn, AB_ROUNDS times, in one device command. The before tree is a `git archive`
# carried in .whl (`git archive <commit> -- . ':!bench/results' > .whl/chat-base.tar`), installed apart
# (pip --target) and its bench/chat.py run from a folder without a batchmaker package, so that no module of this
# tree's editable install stands in for one of its own. Results: $OUT/chat-{before,after}-ROUND.json.
#   OUT=/tmp/gpu bash bench/chat_ab.sh      (AB_ROUNDS "1 2 3", AB_REQUESTS 320, AB_RATES inf,24, AB_LIMIT 200 s)
set -u
OUT=${OUT:-/tmp/gpu}
base=/tmp/chat-base run=/tmp/chat-base-run site=/tmp/chat-base-site
rm -rf "$base" "$run" "$site" && mkdir -p "$base" "$run" && tar -xf .whl/chat-base.tar -C "$base" || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target "$site" "$base" > /dev/null || exit 1
cp -r "$base/bench" "$run/"
(cd "$run" && PYTHONPATH=$site python3 -c "import batchmaker.kernels.paged_attention as m; print('before:', m.__file__)")
python3 -c "import batchmaker.kernels.paged_attention as m; print('after:', m.__file__)"
args=(--device cuda:0 --preset llama-2-7b --dtype bf16 --requests "${AB_REQUESTS:-320}" --rates "${AB_RATES:-inf,24}"
      --max-tokens 2048 --steps "" --systems batchmaker)
for round in ${AB_ROUNDS:-1 2 3}; do
    (cd "$run" && PYTHONPATH=$site timeout "${AB_LIMIT:-200}" python3 bench/chat.py "${args[@]}") | grep "'system'" | cut -c1-160
    mv "$run"/bench/results/chat-*.json "$OUT/chat-before-$round.json"
    timeout "${AB_LIMIT:-200}" python3 bench/chat.py "${args[@]}" | grep "'system'" | cut -c1-160
    mv bench/results/chat-llama-2-7b-*"$(date +%F)".json "$OUT/chat-after-$round.json"
done
