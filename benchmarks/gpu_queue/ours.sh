#!/usr/bin/env bash
# Our runtime's GPU rows still owed (issues 19, 20): no serving engine needed, only torch,
# triton and this project. About 8 min on an H200.
#   R=/tmp/res bash benchmarks/gpu_queue/ours.sh
set -u
R=${R:-/tmp/res}; mkdir -p "$R"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
source "$(dirname "$0")/step.sh"
S=benchmarks/gpu_speedup.py
# adaptive speculation at the issue's six batch sizes (ran 2026-12-06 on an H100 in 91 s under the
# image's own torch, with only pydantic's wheels and this checkout installed: BENCHMARKS.md)
step adaptive 400 python3 $S --out "$R/adaptive" --compile --rows adaptive --batches 1 4 8 16 32 64
# sampled trees (T = 1) and the 8B-shape verify / draft cost per budget
step tree-t1 400 python3 $S --out "$R/tree-t1" --rows tree --tree-temperature 1 --tree-8b \
    --compile --limit 8 --max-new-tokens 128 --tree-batches 1
step gpu-tests 300 python3 -m pytest -q -m gpu tests/dflash tests/kernels -p no:cacheprovider
echo "done at $(( $(date +%s) - t0 )) s" | tee -a "$R/queue.log"
