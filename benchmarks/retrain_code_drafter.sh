#!/usr/bin/env bash
# Second training pass on the data made by train_code_drafter.sh (same $WORK): drafters of depth
# 1, 3, 5, initialised from the target's top layers, larger batch, fixed wall-clock budget.
set -euo pipefail
WORK=${WORK:-/tmp/dflash-train}
TARGET=examples/fixtures/code-target
TRAIN_MINUTES=${TRAIN_MINUTES:-9}
common=(--target $TARGET --data "$WORK/data-greedy" "$WORK/data-t1" --block-size 16 --gamma 7
        --num-anchors 64 --max-seq-len 1024 --batch-size 32 --lr 1.5e-3 --warmup-steps 100
        --max-steps 100000 --time-budget-minutes "$TRAIN_MINUTES" --save-every 1000
        --log-every 50 --device cuda --init-from-target)
for L in 1 3 5; do
    python3 -m dflash_plugin.cli train "${common[@]}" --num-layers $L --out "$WORK/v2-L$L" \
        > "$WORK/train-v2-L$L.log" 2>&1 &
done
wait
python3 benchmarks/acceptance.py --target $TARGET --ngram --prompts examples/fixtures/dev-prompts.jsonl \
    --drafter L1="$WORK/v2-L1" L3="$WORK/v2-L3" L5="$WORK/v2-L5" \
    --max-new-tokens 256 --block-sizes 16 --temperatures 0 --batch-size 64 \
    --device cuda --dtype bfloat16 --out "$WORK/acceptance-v2-gpu.json" > "$WORK/acceptance-v2.log" 2>&1
echo done > "$WORK/DONE2"

# Third pass (what produced examples/fixtures/code-target-dflash-b16): continue the 3-layer
# drafter alone for a few more minutes at a lower learning rate.
python3 -m dflash_plugin.cli train --target $TARGET --data "$WORK/data-greedy" "$WORK/data-t1" \
    --block-size 16 --gamma 7 --num-anchors 64 --max-seq-len 1024 --batch-size 32 --lr 1e-3 \
    --warmup-steps 50 --max-steps 100000 --time-budget-minutes 4.4 --save-every 500 \
    --log-every 100 --device cuda --init-from "$WORK/v2-L3" --out "$WORK/v3-L3" \
    > "$WORK/train-v3-L3.log" 2>&1
