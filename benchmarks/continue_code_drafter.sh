#!/usr/bin/env bash
# Fourth training pass of the bundled drafter, alone on one CUDA GPU (issue 3):
# fresh target continuations (larger generation batches than train_code_drafter.sh, so more data
# in less time), a short side-by-side of the two packed-attention implementations, then the
# shipped 3-layer drafter continues training for a fixed wall-clock budget; tau at B = 16 / 8 and
# T = 0 / 1 for it and for prompt lookup. Run from the repo root:
#   WORK=/tmp/dflash-train OUT=/tmp/out bash benchmarks/continue_code_drafter.sh
set -uo pipefail
WORK=${WORK:-/tmp/dflash-train}
OUT=${OUT:-$WORK/out}
TARGET=examples/fixtures/code-target
START=${START:-examples/fixtures/code-target-dflash-b16}
TRAIN_MINUTES=${TRAIN_MINUTES:-8}
mkdir -p "$WORK" "$OUT"
PY=python3
STDLIB=$($PY -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")
SITE=$($PY -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/steps.log"; }
log "corpus: $STDLIB $SITE"

# FAST=--fast (greedy data through the static-cache runtime with CUDA graphs) was added after
# pass 4, which ran with Hugging Face `generate` (FAST= empty); falls back to it if it fails.
greedy_data() {
    timeout "${GREEDY_SECONDS:-130}" $PY -m dflash_plugin.cli make-data --target $TARGET \
        --out "$WORK/data-greedy" --code-dir "$STDLIB" "$SITE" --prompts-per-file 3 \
        --max-prompts 65536 --max-new-tokens 256 --batch-size 4096 --shard-size 4096 \
        --dtype bfloat16 --device cuda --seed 10 "$@" >> "$OUT/make-data-greedy.log" 2>&1
}
greedy_data ${FAST---fast}
ls "$WORK"/data-greedy/shard-* > /dev/null 2>&1 || greedy_data
log "greedy data: $(ls "$WORK"/data-greedy/shard-* | wc -l) shards"
timeout "${T1_SECONDS:-50}" $PY -m dflash_plugin.cli make-data --target $TARGET \
    --out "$WORK/data-t1" --code-dir "$STDLIB" "$SITE" --prompts-per-file 1 \
    --max-prompts 8192 --max-new-tokens 256 --temperature 1.0 --batch-size 4096 \
    --shard-size 4096 --dtype bfloat16 --device cuda --seed 11 > "$OUT/make-data-t1.log" 2>&1
log "T=1 data: $(ls "$WORK"/data-t1/shard-* | wc -l) shards"
DATA=("$WORK/data-greedy")
ls "$WORK"/data-t1/shard-* > /dev/null 2>&1 && DATA+=("$WORK/data-t1")

common=(--target $TARGET --data "${DATA[@]}" --block-size 16 --gamma 7 --num-anchors 64
        --max-seq-len 1024 --device cuda --log-every 50)
best=dense; best_tps=0
for mode in expand dense; do
    $PY -m dflash_plugin.cli train "${common[@]}" --init-from "$START" --batch-size 32 \
        --lr 1e-4 --warmup-steps 1 --max-steps 40 --save-every 1000 --packed-attention $mode \
        --out "$WORK/ab-$mode" > "$OUT/ab-$mode.log" 2>&1
    tps=$($PY -c "import json;print(int(json.load(open('$WORK/ab-$mode/summary.json'))['tokens_per_second_this_run']))" 2>/dev/null || echo 0)
    log "packed attention $mode: $tps sequence tokens/s (40 steps, batch 32)"
    if [ "$tps" -gt "$best_tps" ]; then best=$mode; best_tps=$tps; fi
done
log "training with --packed-attention $best for $TRAIN_MINUTES min"
$PY -m dflash_plugin.cli train "${common[@]}" --init-from "$START" --batch-size "${BATCH:-64}" \
    --lr "${LR:-6e-4}" --warmup-steps 50 --max-steps 100000 --save-every 100000 \
    --time-budget-minutes "$TRAIN_MINUTES" --packed-attention $best --out "$WORK/v4-L3" \
    > "$OUT/train-v4-L3.log" 2>&1
log "trained: $(tail -c 300 "$OUT/train-v4-L3.log" | tr '\n' ' ')"
mkdir -p "$OUT/v4-L3"
cp "$WORK"/v4-L3/{config.json,model.safetensors,summary.json} "$OUT/v4-L3/"
$PY benchmarks/acceptance.py --target $TARGET --ngram --prompts examples/fixtures/dev-prompts.jsonl \
    --drafter L3v4="$WORK/v4-L3" --max-new-tokens 256 --block-sizes 16 8 --temperatures 0 1 \
    --batch-size 64 --device cuda --dtype bfloat16 --out "$OUT/acceptance-v4-gpu.json" \
    > "$OUT/acceptance-v4.log" 2>&1
log "acceptance done"
echo done > "$OUT/DONE"
