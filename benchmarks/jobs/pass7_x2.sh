#!/usr/bin/env bash
# The device job of 2026-11-30 (second session), as run on nvidia-h200-x2 from a copy of the repo
# at /tmp/repo, wheels in /tmp/site, the code-dllm fixture copied to /tmp/code-dllm beforehand.
# Session 2026-11-30b, nvidia-h200-x2. GPU 0: pass 7 (3 layers, compiled ops); GPU 1: pass 7b
# (5 layers, compiled ops), same data recipe and seeds, each within 15 minutes. Then GPU 0: the
# end-to-end benchmark with the better drafter (or the shipped one); GPU 1: trainer compile A/B,
# then SpecFold end to end with both backends.
export PYTHONPATH=/tmp/site:/tmp/repo PYTHONUNBUFFERED=1
cd /tmp/repo
mkdir -p /tmp/o
S=/tmp/o/steps.log
pass() {  # gpu name layers
    CUDA_VISIBLE_DEVICES=$1 NAME=$2 NUM_LAYERS=$3 COMPILE=1 TOTAL_MINUTES=15 GREEDY_SECONDS=200 \
        GEN_BATCH=1024 PER_FILE=8 T1_SECONDS=0 WORK=/tmp/w-$2 OUT=/tmp/o/$2 \
        bash benchmarks/train_code_drafter_v5.sh
}
echo "$(date +%T) passes start" >> $S
pass 0 v7 3 &
pass 1 v7L5 5 &
wait
echo "$(date +%T) passes done" >> $S
BEST=$(python3 - <<'PY'
import json
best, path = 4.810, "examples/fixtures/code-target-dflash-b16"
for name in ["v7", "v7L5"]:
    try:
        rows = json.load(open(f"/tmp/o/{name}/acceptance-{name}-gpu.json"))["rows"]
    except Exception:
        continue
    for r in rows:
        if r["proposer"] == "L3" + name and r["block_size"] == 16 and r["temperature"] == 0:
            if r["tau"] > best:
                best, path = r["tau"], f"/tmp/w-{name}/{name}-L3"
print(path)
PY
)
echo "$(date +%T) gpu_speedup drafter $BEST" >> $S
(CUDA_VISIBLE_DEVICES=0 DFLASH_ORACLE_DIR=.carry/oracle timeout 420 python3 benchmarks/gpu_speedup.py \
    --out /tmp/o/gs --drafter $BEST --compile --slow-limit 4 > /tmp/o/gs.log 2>&1;
 echo "$(date +%T) gpu_speedup rc $?" >> $S) &
(mkdir -p /tmp/w-v7/sub && ln -sf /tmp/w-v7/data-greedy/shard-0000[0-2].pt /tmp/w-v7/sub/
 CUDA_VISIBLE_DEVICES=1 timeout 200 python3 benchmarks/train_step_bench.py --data /tmp/w-v7/sub \
    --out /tmp/o/ts --batches 64 --steps 80 --compile 0 1 > /tmp/o/ts.log 2>&1
 echo "$(date +%T) train_step_bench rc $?" >> $S
 CUDA_VISIBLE_DEVICES=1 timeout 300 python3 benchmarks/specfold_bench.py --model /tmp/code-dllm \
    --prompts examples/fixtures/dev-prompts.jsonl --calib 32:40 --eval 0:4 --max-new-tokens 128 \
    --budget 10 --deltas 0 0.05 0.1 --sections e2e --backends torch triton --out /tmp/o/sf \
    > /tmp/o/sf.log 2>&1
 echo "$(date +%T) specfold e2e rc $?" >> $S) &
wait
echo done > /tmp/o/ALLDONE
