#!/usr/bin/env bash
# Device job of 2026-11-30 (third session), nvidia-h200, run from the repo root with the code-dllm
# fixture carried in .carry/code-dllm and the pydantic wheels in .whl: SpecFold end to end on 16
# prompts with the window-8 capacity planner, against Spiffy on the reference decoder and on the
# same kernels; bf16 (both backends), then fp32 (kernel backend only).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,utilization.gpu,memory.used --format=csv
common="--model .carry/code-dllm --prompts examples/fixtures/dev-prompts.jsonl --calib 32:40
    --eval 0:16 --max-new-tokens 128 --budget 10 --deltas 0.05 0.1 --sections e2e"
timeout 330 python benchmarks/specfold_bench.py $common --backends torch triton \
    --out $OUT/e2e-bf16 2>&1 | grep -v -e Loading -e calibrate | tee $OUT/e2e-bf16.log
timeout 200 python benchmarks/specfold_bench.py $common --backends triton --dtype float32 \
    --out $OUT/e2e-fp32 2>&1 | grep -v -e Loading -e calibrate | tee $OUT/e2e-fp32.log
