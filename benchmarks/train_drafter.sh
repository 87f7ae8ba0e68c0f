#!/usr/bin/env bash
# The recipe of the bundled drafter (examples/fixtures/code-target-dflash-b16): greedy target
# continuations through the static-cache runtime (`dflash make-data --fast`) for GREEDY_SECONDS,
# then a NUM_LAYERS-layer drafter, initialised from the target's top layers, trains with compiled
# elementwise ops for whatever is left of TOTAL_MINUTES; last, tau at B = 16 / 8 and T = 0 / 1 for
# it and for prompt lookup on the 64 held-out dev prompts. One CUDA GPU, run from the repo root:
#   bash benchmarks/train_drafter.sh                     # writes out/train-drafter/
# The defaults are the shipped run (5 layers, 15 minutes of one H200, data included). Knobs:
# WORK / OUT (folders), NAME (drafter folder and file names), NUM_LAYERS, COMPILE (empty: eager),
# TOTAL_MINUTES (empty: TRAIN_MINUTES of training after the data steps), GREEDY_SECONDS,
# GEN_BATCH, PER_FILE, T1_SECONDS (> 0 adds sampled T = 1 data; T1_SHARD must be small enough to
# finish in that time), BATCH, LR, DEVICE, DTYPE, PY.
# CPU smoke run of the plumbing (minutes, meaningless numbers):
#   DEVICE=cpu DTYPE=float32 COMPILE= TOTAL_MINUTES= MAX_PROMPTS=48 GREEDY_SECONDS=120 \
#   TRAIN_MINUTES=0.3 BATCH=4 GEN_BATCH=16 SHARD=16 EVAL_LIMIT=2 EVAL_TOKENS=32 \
#   WORK=out/train-smoke bash benchmarks/train_drafter.sh
set -uo pipefail
WORK=${WORK:-out/train-drafter}
OUT=${OUT:-$WORK/out}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bfloat16}
TARGET=examples/fixtures/code-target
TRAIN_MINUTES=${TRAIN_MINUTES:-11}
NAME=${NAME:-v7L5}  # names the drafter folder, logs and the acceptance file
NUM_LAYERS=${NUM_LAYERS:-5}
COMPILE=${COMPILE-1}
TOTAL_MINUTES=${TOTAL_MINUTES-15}
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
make_data "${GREEDY_SECONDS:-200}" "$WORK/data-greedy" --fast --prompts-per-file "${PER_FILE:-8}" \
    --max-prompts "${MAX_PROMPTS:-163840}" --batch-size "${GEN_BATCH:-1024}" --seed 20 \
    > "$OUT/make-data-greedy.log" 2>&1
log "greedy data (--fast): $(ls "$WORK"/data-greedy/shard-* 2>/dev/null | wc -l) shards"
if ! ls "$WORK"/data-greedy/shard-* > /dev/null 2>&1; then
    log "fast make-data wrote nothing; falling back to Hugging Face generate"
    make_data 150 "$WORK/data-greedy-hf" --prompts-per-file 3 --max-prompts 65536 \
        --batch-size 4096 --seed 20 > "$OUT/make-data-greedy-hf.log" 2>&1
fi
[ "${T1_SECONDS:-0}" -gt 0 ] && \
    make_data "${T1_SECONDS:-0}" "$WORK/data-t1" --prompts-per-file 1 --temperature 1.0 \
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
    --num-anchors 64 --max-seq-len 1024 --device "$DEVICE" --log-every 100 --num-layers "$NUM_LAYERS" \
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
