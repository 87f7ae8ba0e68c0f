#!/usr/bin/env bash
# Train the bundled code-target's DFlash drafters on one CUDA GPU, then measure tau.
# Run from the repo root:  WORK=/tmp/dflash-train bash benchmarks/train_code_drafter.sh
# Steps: (1) prompts cut from the Python files of this machine's stdlib and site-packages,
# excluding every path containing /sympy/, /networkx/ or /scipy/ (held out for evaluation);
# (2) the target's own continuations (greedy, plus a sampled T=1 share); (3) drafters of depth
# 1, 3 and 5 (and 3 initialised from the target's top layers) trained side by side for a fixed
# wall-clock budget; (4) tau on examples/fixtures/dev-prompts.jsonl.
set -euo pipefail
WORK=${WORK:-/tmp/dflash-train}
TARGET=examples/fixtures/code-target
TRAIN_MINUTES=${TRAIN_MINUTES:-9}
DATA_SECONDS=${DATA_SECONDS:-210}
mkdir -p "$WORK"
PY=python3
STDLIB=$($PY -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")
SITE=$($PY -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "corpus: $STDLIB $SITE"; date

timeout "$DATA_SECONDS" $PY -m dflash_plugin.cli make-data --target $TARGET \
    --out "$WORK/data-greedy" --code-dir "$STDLIB" "$SITE" --prompts-per-file 2 \
    --max-prompts 24576 --max-new-tokens 256 --batch-size 1024 --shard-size 2048 \
    --dtype bfloat16 --device cuda --seed 0 || echo "make-data (greedy) stopped at its budget"
timeout 60 $PY -m dflash_plugin.cli make-data --target $TARGET \
    --out "$WORK/data-t1" --code-dir "$STDLIB" "$SITE" --prompts-per-file 1 \
    --max-prompts 4096 --max-new-tokens 256 --temperature 1.0 --batch-size 1024 \
    --shard-size 1024 --dtype bfloat16 --device cuda --seed 1 || echo "make-data (T=1) stopped"
ls "$WORK"/data-*; date

common=(--target $TARGET --data "$WORK/data-greedy" "$WORK/data-t1" --block-size 16 --gamma 7
        --num-anchors 64 --max-seq-len 1024 --batch-size 16 --lr 1e-3 --warmup-steps 100
        --max-steps 100000 --time-budget-minutes "$TRAIN_MINUTES" --save-every 2000
        --log-every 50 --device cuda)
for L in 1 3 5; do
    $PY -m dflash_plugin.cli train "${common[@]}" --num-layers $L --out "$WORK/L$L" \
        > "$WORK/train-L$L.log" 2>&1 &
done
$PY -m dflash_plugin.cli train "${common[@]}" --num-layers 3 --init-from-target \
    --out "$WORK/L3-init" > "$WORK/train-L3-init.log" 2>&1 &
wait
date
$PY benchmarks/acceptance.py --target $TARGET --ngram --prompts examples/fixtures/dev-prompts.jsonl \
    --drafter L1="$WORK/L1" L3="$WORK/L3" L5="$WORK/L5" L3init="$WORK/L3-init" \
    --max-new-tokens 256 --block-sizes 16 8 --temperatures 0 1 --batch-size 64 \
    --device cuda --dtype bfloat16 --out "$WORK/acceptance-gpu.json" > "$WORK/acceptance.log" 2>&1
date
echo done > "$WORK/DONE"
