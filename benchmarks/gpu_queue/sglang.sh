#!/usr/bin/env bash
# The SGLang rows still owed on one GPU (issues 18, 19, 20), most wanted first, each under its
# own time limit, logs and JSON under $R; a step that fails is logged and the next one runs.
# Needs: SGLang 0.5.16's GPU build and this project importable (PYTHONPATH), the repo root as
# working directory with the fixtures in place. About 25 min on an H200 with a warm flashinfer
# JIT cache (its first engine start compiles for 2-4 min).
#   R=/tmp/res bash benchmarks/gpu_queue/sglang.sh      # then: tail $R/queue.log
set -u
R=${R:-/tmp/res}; mkdir -p "$R"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} SGLANG_PLUGINS=${SGLANG_PLUGINS:-dflash_plugin}
t0=$(date +%s)
step() {  # step NAME LIMIT_S CMD...: one line per step in $R/queue.log, its output in NAME.log
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" > "$R/$name.log" 2>&1
  echo "$name rc=$? at $(( $(date +%s) - t0 )) s" | tee -a "$R/queue.log"
}
T=benchmarks/gpu_tree_sglang.py
# 1. the tree phase's CUDA graph equals the eager phase (no engine; seconds)
step stage 120 python3 -m pytest -q -m gpu tests/engines/test_sglang_tree_stage.py -p no:cacheprovider
# 2. lossless in SGLang: fp32 greedy identity of DFLASH_TREE (and DFLASH) with plain decoding
step fp32 600 python3 $T all --dtype float32 --modes plain dflash tree32 --prompts 8 \
    --max-new-tokens 128 --concurrency 1 --out "$R/tree-fp32"
# 3. where a tree round's time goes, graphed tree phase vs eager (warmed 1 and 8 requests)
step profile 300 env DFLASH_TREE_PROFILE=50 python3 $T run --mode tree32 --prompts 8 \
    --max-new-tokens 128 --out "$R/tree-graphs"
step profile-eager 300 env DFLASH_TREE_PROFILE=50 DFLASH_TREE_GRAPHS=0 python3 $T run \
    --mode tree32 --prompts 8 --max-new-tokens 128 --out "$R/tree-eager"
# 4. Spiffy under SGLang's CUDA graphs: fp32 identity with LowConfidence (issue 18)
W=$R/dllm; D=$R/gpu-dllm-fp32
step dllm-prepare 120 python3 benchmarks/gpu_dllm.py prepare --work "$W"
step dllm-lowconf 300 python3 benchmarks/gpu_dllm.py run --work "$W" --algorithm LowConfidence \
    --dtype float32 --out "$D/lowconf.json"
step dllm-spiffy 300 python3 benchmarks/gpu_dllm.py run --work "$W" --algorithm Spiffy \
    --dtype float32 --out "$D/spiffy.json"
step dllm-report 60 python3 benchmarks/gpu_dllm.py report --inputs "$D"/*.json --out-md "$D/report.md"
# 5. DFLASH_TREE in the warmed engine harness and its round at the Qwen3-8B shape
E=$R/gpu-engines
step engines-tree32 600 python3 benchmarks/gpu_engines.py run --engine sglang --mode tree \
    --num-spec-tokens 32 --no-prefill-graphs --temperatures 0 --out "$E/sglang-tree32.json"
for m in plain dflash tree; do
  step "round-$m" 400 python3 benchmarks/gpu_engines.py round-cost --engine sglang --mode $m \
      --num-spec-tokens $([ $m = tree ] && echo 32 || echo 15) --no-prefill-graphs \
      --shape qwen3-8b --out "$E/round-sglang-$m.json"
done
step report 60 python3 $T report --out "$R/tree-fp32"
echo "done at $(( $(date +%s) - t0 )) s" | tee -a "$R/queue.log"
