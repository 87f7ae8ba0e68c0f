#!/usr/bin/env bash
# Issue 22 on an `nvidia-h200-x2` machine: the plugins under tensor parallelism (TP = 2) in vLLM
# 0.26.0 and SGLang 0.5.16, then the same runs at TP = 1 for the identity (two lanes, one GPU
# each). Most wanted first; each step under its own limit; logs and JSON under $R.
# Needs both engines' GPU builds in their own folders, this project installed into each:
#   SGL_SITE=/tmp/S/gpu/site VLLM_SITE=/tmp/V/gpu/site R=/tmp/res bash benchmarks/gpu_queue/tp2.sh
# (VLLM_READY, if set, is a file the vLLM steps wait for: the vLLM install may still be running.)
# Ran 2026-12-04: every engine row (`eng`), TP 2 and TP 1 (BENCHMARKS.md). Still owed, for the
# next x2 machine: STEPS="dllm-prepare dllm-spiffy-tp2 dllm-specfold-e-tp2 dllm-lowconf-tp2
#   round-sglang-tree-tp2 round-sglang-dflash-tp2 round-sglang-plain-tp2 round-vllm-dflash-tp2
#   round-vllm-plain-tp2 dllm-lowconf-tp1 dllm-spiffy-tp1 dllm-specfold-e-tp1
#   round-sglang-tree-tp1 round-sglang-dflash-tp1 round-sglang-plain-tp1 round-vllm-dflash-tp1
#   round-vllm-plain-tp1" (the dLLM runs read benchmarks/results/gpu-dllm/graph-vanilla1-d8.json)
# Afterwards, on any machine: gpu_engines.py compare / report and gpu_dllm.py compare / report
# (their docstrings), and greedy_margins.py for any T = 0 output that differs.
set -u
R=${R:-/tmp/res}; mkdir -p "$R"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# NVLink multicast stays off (the machine's rule; KINDS.md of the device tool), also in vLLM's
# symmetric-memory all-reduce, which would use it
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export VLLM_ALLREDUCE_USE_SYMM_MEM=0
unset SGLANG_PLUGINS
source "$(dirname "$0")/step.sh"
E=$R/gpu-engines-tp2 D=$R/gpu-dllm-tp2 W=/tmp/gpu-dllm; mkdir -p "$E" "$D"
ROWS=(--num-prompts 16 --max-tokens 128 --warmup-tokens 16 --concurrency 1 16 --temperatures 0
      --no-prefill-graphs)
SG=(env PYTHONPATH="$SGL_SITE") VL=(env PYTHONPATH="$VLLM_SITE")  # `timeout` runs no functions
eng() {  # eng ENGINE MODE TP [ARGS...]: one gpu_engines.py run
  local e=$1 m=$2 tp=$3; shift 3
  local run=("${SG[@]}")
  if [ "$e" = vllm ]; then
    run=("${VL[@]}")  # waits up to 5 min for the install
    for _ in $(seq 150); do { [ -z "${VLLM_READY:-}" ] || [ -f "$VLLM_READY" ]; } && break; sleep 2; done
  fi
  step "$e-$m-tp$tp" 480 "${run[@]}" python3 benchmarks/gpu_engines.py run --engine "$e" --mode "$m" \
      --tp "$tp" "${ROWS[@]}" "$@" --out "$E/$e-$m-tp$tp.json"
}
TREE=(--num-spec-tokens 32 --draft-attention-backend fa3)
dl() {  # dl ALGORITHM LABEL TP [ARGS...]: one gpu_dllm.py run
  local a=$1 l=$2 tp=$3; shift 3
  step "dllm-$l-tp$tp" 300 "${SG[@]}" python3 benchmarks/gpu_dllm.py run --work "$W" --tp "$tp" \
      --algorithm "$a" "$@" --out "$D/$l-tp$tp.json"
}
rc() {  # rc ENGINE MODE TP [ARGS...]: one gpu_engines.py round-cost at the Qwen3-8B shape
  local e=$1 m=$2 tp=$3; shift 3
  local run=("${SG[@]}"); [ "$e" = vllm ] && run=("${VL[@]}")
  step "round-$e-$m-tp$tp" 420 "${run[@]}" python3 benchmarks/gpu_engines.py round-cost \
      --engine "$e" --mode "$m" --tp "$tp" --shape qwen3-8b --no-prefill-graphs "$@" \
      --out "$E/round-$e-$m-tp$tp.json"
}
# TP = 2, one run at a time over both GPUs (SGLang first: the vLLM install may still run)
eng sglang dflash 2
eng sglang plain 2
eng sglang tree 2 "${TREE[@]}"
eng vllm dflash 2
eng vllm plain 2
step dllm-prepare 120 "${SG[@]}" python3 benchmarks/gpu_dllm.py prepare --work "$W"
dl Spiffy spiffy 2
dl SpecFold specfold-e 2 --eager
dl LowConfidence lowconf 2
rc sglang tree 2 "${TREE[@]}"; rc sglang dflash 2; rc sglang plain 2
rc vllm dflash 2; rc vllm plain 2
# TP = 1, the same runs in two lanes, one GPU each
( export CUDA_VISIBLE_DEVICES=0
  eng sglang tree 1 "${TREE[@]}"; eng sglang dflash 1; eng sglang plain 1
  dl LowConfidence lowconf 1
  rc sglang tree 1 "${TREE[@]}"; rc sglang dflash 1; rc sglang plain 1
) &
( export CUDA_VISIBLE_DEVICES=1
  eng vllm dflash 1; eng vllm plain 1; dl Spiffy spiffy 1; dl SpecFold specfold-e 1 --eager
  rc vllm dflash 1; rc vllm plain 1
) &
wait
echo "done at $(( $(date +%s) - t0 )) s" | tee -a "$R/queue.log"
