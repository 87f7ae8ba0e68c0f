#!/usr/bin/env bash
# Fifth training pass (issue 3): one clean run from scratch, alone on one CUDA GPU, within the
# issue's 15-minute training budget. Greedy target continuations through the static-cache
# runtime (`make-data --fast`, many more than Hugging Face `generate` gave), a few sampled ones
# (T = 1, `generate`), then a 3-layer drafter initialised from the target's top layers trains for
# TRAIN_MINUTES; tau at B = 16 / 8 and T = 0 / 1 for it and for prompt lookup. Run from the root:
#   WORK=/tmp/dflash-train OUT=/tmp/out bash benchmarks/train_code_drafter_v5.sh
# Pass 5 ran with the defaults. TOTAL_MINUTES=15 instead gives training whatever the data steps
# left of 15 minutes (pass 6: NAME=v6 TOTAL_MINUTES=15 GREEDY_SECONDS=240 GEN_BATCH=1024 PER_FILE=8
# T1_SECONDS=0, the sync-free trainer). T1_SECONDS=0 skips the sampled (T = 1) data; sampled
# shards need to be small enough (T1_SHARD) to finish in T1_SECONDS. NUM_LAYERS sets the drafter
# depth (the folder keeps the name NAME-L3); COMPILE=1 compiles the drafter's elementwise ops
# (`dflash train --compile`).
# CPU smoke run of the plumbing (minutes, meaningless numbers):
#   DEVICE=cpu DTYPE=float32 MAX_PROMPTS=48 GREEDY_SECONDS=120 T1_PROMPTS=16 TRAIN_MINUTES=0.3 \
#   BATCH=4 GEN_BATCH=16 SHARD=16 EVAL_LIMIT=2 EVAL_TOKENS=32 WORK=/tmp/v5 OUT=/tmp/v5/out \
#   bash benchmarks/train_code_drafter_v5.sh
set -uo pipefail
WORK=${WORK:-/tmp/dflash-train}
OUT=${OUT:-$WORK/out}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bfloat16}
TARGET=examples/fixtures/code-target
TRAIN_MINUTES=${TRAIN_MINUTES:-11}
NAME=${NAME:-v5}  # names the drafter folder, logs and the acceptance file
SHARD=${SHARD:-4096}
mkdir -p "$WORK" "$OUT"
PY=${PY:-python3}
STDLIB=$($PY -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")
SITE=$($PY -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/steps.log"; }
log "corpus: $STDLIB $SITE"
T_START=$(date +%s)

make_data() {  # seconds, out folder, extra args
    local secs=$1 dir=$2; shift 2
    timeout "$secs" $PY -m dflash_plugin.cli make-data --target $TARGET --out "$dir" \
        --code-dir "$STDLIB" "$SITE" --max-new-tokens 256 --shard-size "$SHARD" \
        --dtype "$DTYPE" --device "$DEVICE" "$@"
}
make_data "${GREEDY_SECONDS:-210}" "$WORK/data-greedy" --fast --prompts-per-file "${PER_FILE:-6}" \
    --max-prompts "${MAX_PROMPTS:-163840}" --batch-size "${GEN_BATCH:-512}" --seed 20 \
    > "$OUT/make-data-greedy.log" 2>&1
log "greedy data (--fast): $(ls "$WORK"/data-greedy/shard-* 2>/dev/null | wc -l) shards"
if ! ls "$WORK"/data-greedy/shard-* > /dev/null 2>&1; then
    log "fast make-data wrote nothing; falling back to Hugging Face generate"
    make_data 150 "$WORK/data-greedy-hf" --prompts-per-file 3 --max-prompts 65536 \
        --batch-size 4096 --seed 20 > "$OUT/make-data-greedy-hf.log" 2>&1
fi
[ "${T1_SECONDS:-60}" -gt 0 ] && make_data "${T1_SECONDS:-60}" "$WORK/data-t1" --prompts-per-file 1 --temperature 1.0 \
    --max-prompts "${T1_PROMPTS:-8192}" --batch-size "${GEN_BATCH:-1024}" --seed 21 \
    --shard-size "${T1_SHARD:-$SHARD}" \
    > "$OUT/make-data-t1.log" 2>&1
log "T=1 data: $(ls "$WORK"/data-t1/shard-* 2>/dev/null | wc -l) shards"
DATA=()
for d in data-greedy data-greedy-hf data-t1; do
    ls "$WORK/$d"/shard-* > /dev/null 2>&1 && DATA+=("$WORK/$d")
done

remaining() { $PY -c "print(round($TOTAL_MINUTES - ($(date +%s) - $T_START) / 60, 2))"; }
if [ -n "${TOTAL_MINUTES:-}" ]; then  # data time counts against the whole budget
    TRAIN_MINUTES=$(remaining)
fi
train() {
$PY -m dflash_plugin.cli train --target $TARGET --data "${DATA[@]}" --block-size 16 --gamma 7 \
    --num-anchors 64 --max-seq-len 1024 --device "$DEVICE" --log-every 100 --num-layers "${NUM_LAYERS:-3}" \
    --init-from-target --batch-size "${BATCH:-64}" --lr "${LR:-1.2e-3}" --warmup-steps 200 \
    --max-steps 1000000 --save-every 1000000 --time-budget-minutes "$TRAIN_MINUTES" \
    --packed-attention dense --seed 5 "$@" --out "$WORK/$NAME-L3" > "$OUT/train-$NAME-L3.log" 2>&1
}
log "training from the target's top layers for $TRAIN_MINUTES min on ${DATA[*]}"
train ${COMPILE:+--compile}
if [ -n "${COMPILE:-}" ] && ! grep -q '"final_loss"' "$OUT/train-$NAME-L3.log"; then
    mv "$OUT/train-$NAME-L3.log" "$OUT/train-$NAME-L3-compile-failed.log"
    rm -rf "${WORK:?}/$NAME-L3"
    [ -n "${TOTAL_MINUTES:-}" ] && TRAIN_MINUTES=$(remaining)
    log "compiled training failed; eager for $TRAIN_MINUTES min"
    train
fi
log "trained: $(grep -o '"final_loss": [0-9.]*' "$OUT/train-$NAME-L3.log")"
mkdir -p "$OUT/$NAME-L3"
cp "$WORK/$NAME-L3"/{config.json,model.safetensors,summary.json} "$OUT/$NAME-L3/"
$PY benchmarks/acceptance.py --target $TARGET --ngram --prompts examples/fixtures/dev-prompts.jsonl \
    --drafter "L3$NAME=$WORK/$NAME-L3" \
    --max-new-tokens "${EVAL_TOKENS:-256}" --block-sizes 16 8 --temperatures 0 1 \
    --limit "${EVAL_LIMIT:-64}" --batch-size 64 --device "$DEVICE" --dtype "$DTYPE" \
    --out "$OUT/acceptance-$NAME-gpu.json" > "$OUT/acceptance-$NAME.log" 2>&1
log "acceptance done"
echo done > "$OUT/DONE"
