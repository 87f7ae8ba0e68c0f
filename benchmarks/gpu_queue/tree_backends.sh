#!/usr/bin/env bash
# Where a DFLASH_TREE round's wall time goes, per attention backend (issue 19): on the H200
# (2026-12-02) the 32-node tree round took 4.7 ms on the GPU timeline but 7.0 ms of wall time,
# DFLASH's round 3.1 ms; DFLASH ran on SGLang's default backend, the tree on flashinfer.
# Each row: 8 prompts x 128 tokens at 1 and 8 requests, DFLASH_TREE_PROFILE=50 (GPU and host
# time per phase, whether drafter and verify replayed CUDA graphs) in $R/tree-backends/*.log.
#   R=/tmp/res bash benchmarks/gpu_queue/tree_backends.sh "tree32 flashinfer" "dflash fa3" ...
set -u
R=${R:-/tmp/res}/tree-backends; mkdir -p "$R"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export DFLASH_TREE_PROFILE=${DFLASH_TREE_PROFILE:-50}
unset SGLANG_PLUGINS  # every plugin of ours loads
t0=$(date +%s)
for spec in "$@"; do
  set -- $spec; m=$1; b=$2
  timeout "${LIMIT:-300}" python3 benchmarks/gpu_tree_sglang.py run --mode "$m" \
      --attention-backend "$b" --prompts 8 --max-new-tokens 128 --concurrency 1 8 \
      --out "$R/$b" > "$R/$m-$b.log" 2>&1
  echo "$m $b rc=$? at $(( $(date +%s) - t0 )) s" | tee -a "$R/queue.log"
  grep -h "round profile\|CUDA graph\|tokens_per_s" "$R/$m-$b.log" | tail -6
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print([(r['concurrency'], round(r['tokens_per_s']), r['tau'] and round(r['tau'],2)) for r in d['rows']])" "$R/$b/$m.json" 2>/dev/null
done
