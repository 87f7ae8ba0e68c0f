#!/usr/bin/env bash
# Device job of 2026-11-30 (third session), nvidia-h200, from the repo root with the code-dllm
# fixture in .carry/code-dllm and the pydantic wheels in .whl: the kernel backend's capacity
# modes. (1) Verify-forward latency at the Qwen3-8B shape: dense graph vs folded graph at the
# true counts, with the planner's margin, and sized per gate at run time (sync, eager).
# (2) End to end on the fixture, 16 prompts: planned vs sync capacities, bf16.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,utilization.gpu,memory.used --format=csv
timeout 300 python benchmarks/specfold_fast_bench.py --model .carry/code-dllm --sections 8b \
    --sync --deltas 0.05 0.1 --branches 4 8 --requests-8b 1 4 8 --budget-s 240 \
    --out $OUT/fast 2>&1 | grep -v -e Loading | tee $OUT/fast.log
timeout 240 python benchmarks/specfold_bench.py --model .carry/code-dllm \
    --prompts examples/fixtures/dev-prompts.jsonl --calib 32:40 --eval 0:16 --max-new-tokens 128 \
    --budget 10 --deltas 0.05 0.1 --sections e2e --backends triton --capacities plan sync \
    --out $OUT/e2e 2>&1 | grep -v -e Loading -e calibrate | tee $OUT/e2e.log
