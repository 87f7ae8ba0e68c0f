#!/usr/bin/env bash
# The SGLang rows still owed on one GPU (issues 18, 19, 20), most wanted first, each under its
# own time limit, logs and JSON under $R; a step that fails is logged and the next one runs.
# Needs: SGLang 0.5.16's GPU build and this project importable (PYTHONPATH), the repo root as
# working directory with the fixtures in place. About 25 min on an H200 with a warm flashinfer
# JIT cache (its first engine start compiles for 2-4 min).
#   R=/tmp/res bash benchmarks/gpu_queue/sglang.sh      # then: tail $R/queue.log
#   STEPS="dllm-prepare dllm-lowconf" R=/tmp/res bash benchmarks/gpu_queue/sglang.sh  # some steps
# 2026-12-07 (second session, H100): goal-adm (twice), steady-admission and solo-32 ran
#   (BENCHMARKS.md "Admission by cost"); DFLASH_BATCH_ADMISSION=cost is the default since, so
#   the steps that set it only pin it. Still owed below: steady-admission-8 and the rest.
# Owed as of 2026-12-06 late (that session ran prefill-append-unit, passed, goal-steady and
#   solo 32-request servers by hand: BENCHMARKS.md "Steady load"; rows run 16 waves by default
#   since, so goal-cuts and goal-ctx4096 are goal-steady now), most wanted
#   first; every step reads benchmarks/results/gpu-engines/tune-sglang.json, so it must be in
#   the uploaded checkout. Issue 20 first (the 32-request row's admissions at steady load: DFLASH
#   under the limit-32 servers' rule, our hold at the sweep's limit), then issue 19's:
#   STEPS="solo-32 steady-admission goal-adm steady-admission-8 goal-cuts-spread profile-32
#   adaptive-t1 adaptive-rep
#   kernels-tree-fa3-fast-8b fa3tree64-fast sampling-tree-fast tree-build-bench fa3tree
#   sampling-plain2 fa3tree8-t1 fa3tree16-t1 lateseq-check engines-tree32-lateseq"
#   (sampling-plain2 beside a fresh sampling-plain: the first plain2 shared plain's seed and
#   replayed its random numbers). Times on an H100 (2026-12-06): staging 10 parts about 45 s and
#   the install 12 s on a fresh machine (the first engine start compiled little that night),
#   host-cuts-ab 460 s, spread-32 245 s, async-prefill-8b 385 s, tree-asyncprefill 255 s,
#   adaptive-starts 426-543 s, plainattn-ab 381 s, profile-8b-64 239 s, a warm round-cost 50-120 s, adaptive 235-370 s, adaptive-rep
#   485 s, admission-goal 415 s, decode-prep-check 58 s, decode-prep-ab 306 s, profile-32
#   156 s; one 30-minute session fits about three 8-minute steps, one device call each (10
#   minutes per call); a machine that does not start costs 1-2 minutes of it. The fixtures
#   must be real files or links in examples/fixtures (a checkout sent
#   without them holds an empty code-target folder: remove it and link
#   /tmp/gpu/files/examples/fixtures/* there). The device returns files at most two folders
#   below $OUT: tar deeper result folders into $OUT.
set -u
R=${R:-/tmp/res}; mkdir -p "$R"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
unset SGLANG_PLUGINS  # every plugin of ours loads (dflash_plugin alone left Spiffy unregistered)
source "$(dirname "$0")/step.sh"
T=benchmarks/gpu_tree_sglang.py
E=$R/gpu-engines
# 1. the tree phase's CUDA graphs (one per batch bucket, `warm`) equal the eager phase (no engine;
#    seconds); if not, the later tree steps run the eager tree phase (DFLASH_TREE_GRAPHS=0)
step stage 120 python3 -m pytest -q -m gpu tests/engines/test_sglang_tree_stage.py \
    tests/engines/test_sglang_tree_append.py tests/engines/test_sglang_tree_accept.py \
    tests/dflash/test_tree_race.py -p no:cacheprovider
failed stage && { export DFLASH_TREE_GRAPHS=0; echo "tree graphs off" | tee -a "$R/queue.log"; }
# 1b. the fused tree-build and acceptance kernels against their torch references, compiled (no
#     engine; seconds);
#     if they fail, the `fast` steps below use torch
B=triton
step tree-kernel 300 python3 -m pytest -q tests/kernels/test_tree_build.py \
    tests/kernels/test_tree_accept.py tests/kernels/test_tree_rejection.py -p no:cacheprovider
failed tree-kernel && { B=torch; echo "tree build: torch" | tee -a "$R/queue.log"; }
step tree-build-bench 300 python3 benchmarks/tree_build_bench.py --out "$R/tree-build"
# 0. DFLASH_TREE with fa3 as the target's backend too (`--attention-backend fa3`): the tree
#    verified by fa3's top-K > 1 cascade, no backend that asks the scheduler for host lengths.
#    Ran 2026-12-04 (BENCHMARKS.md): 8B round 8.06 ms (8.76 with flashinfer), fixture 0.91x
#    DFLASH at 1 request, T = 0 margins 0.062. Next: its T = 1 rows beside DFLASH's (0t1)
step fa3tree 600 python3 benchmarks/gpu_engines.py run --engine sglang --mode tree \
    --num-spec-tokens 32 --attention-backend fa3 --no-prefill-graphs --concurrency 1 4 8 \
    --temperatures 0 1 --out "$E/sglang-tree32-fa3.json"
step kernels-tree-fa3-8b 400 python3 benchmarks/gpu_engines.py round-cost --engine sglang \
    --mode tree --num-spec-tokens 32 --attention-backend fa3 --no-prefill-graphs \
    --shape qwen3-8b --kernel-trace /tmp/traces/tree-fa3 --out "$E/kernels-sglang-tree-fa3-8b.json"
# 0fa. the cuts of 2026-12-04 night (not yet on a GPU): the greedy acceptance, both KV moves
#      and the drafter append in one graph per bucket (DFLASH_TREE_FAST_ACCEPT), fa3's
#      tree-verify metadata in one graph per batch (DFLASH_TREE_FA3_GRAPH) and the tree build
#      and the greedy walk in one kernel each (DFLASH_TREE_KERNELS, step 1b). First the first two in their
#      check modes (each round also runs SGLang's own acceptance / eager metadata and raises on a
#      difference), then the T = 0 and T = 1 rows with both on beside `fa3tree` (above) and
#      DFLASH's rows of the same session, then the 8B round; margins on CPU:
#      python benchmarks/greedy_margins.py --runs $E/sglang-tree32-fa3-fast.json --out ...
#      The check runs T = 1 too: since 2026-12-05 the fast acceptance also takes T > 0 rounds
#      (a sample per node, `race_sample`), each walk compared with SGLang's walk of the same samples
step fastcheck 400 env DFLASH_TREE_FAST_ACCEPT=check DFLASH_TREE_FA3_GRAPH=check \
    DFLASH_TREE_KERNELS=$B python3 \
    benchmarks/gpu_engines.py run --engine sglang --mode tree --num-spec-tokens 32 \
    --attention-backend fa3 --no-prefill-graphs --num-prompts 8 --max-tokens 64 \
    --concurrency 1 4 --temperatures 0 1 --out "$E/sglang-tree32-fa3-fastcheck.json"
step fa3tree-fast 600 env DFLASH_TREE_FAST_ACCEPT=1 DFLASH_TREE_FA3_GRAPH=1 DFLASH_TREE_KERNELS=$B \
    python3 \
    benchmarks/gpu_engines.py run --engine sglang --mode tree --num-spec-tokens 32 \
    --attention-backend fa3 --no-prefill-graphs --concurrency 1 4 8 --temperatures 0 1 \
    --out "$E/sglang-tree32-fa3-fast.json"
# 0f64. 64 nodes with the fast acceptance: at the host-bound fixture a wider verify costs little
#       more (8B shape: 64 nodes 11.13 ms against 32 nodes' 9.89, 2026-12-03) and tau was 7.91
#       against 7.38-7.65 at 32 (2026-12-03/04)
step fa3tree64-fast 600 env DFLASH_TREE_FAST_ACCEPT=1 DFLASH_TREE_FA3_GRAPH=1 \
    DFLASH_TREE_KERNELS=$B python3 \
    benchmarks/gpu_engines.py run --engine sglang --mode tree --num-spec-tokens 64 \
    --attention-backend fa3 --no-prefill-graphs --concurrency 1 4 8 --temperatures 0 1 \
    --out "$E/sglang-tree64-fa3-fast.json"
step engines-dflash-fa 600 python3 benchmarks/gpu_engines.py run --engine sglang --mode dflash \
    --no-prefill-graphs --temperatures 0 1 --concurrency 1 4 8 --out "$E/sglang-dflash-fa.json"
step kernels-tree-fa3-fast-8b 400 env DFLASH_TREE_FAST_ACCEPT=1 DFLASH_TREE_FA3_GRAPH=1 \
    DFLASH_TREE_KERNELS=$B python3 \
    benchmarks/gpu_engines.py round-cost --engine sglang --mode tree --num-spec-tokens 32 \
    --attention-backend fa3 --no-prefill-graphs --shape qwen3-8b \
    --kernel-trace /tmp/traces/tree-fa3-fast --out "$E/kernels-sglang-tree-fa3-fast-8b.json"
# 0rrs. T = 1 by recursive rejection sampling (DFLASH_TREE_RRS=1; H100 2026-12-05: 1.96x DFLASH:
#       siblings drawn from the drafter's q, the walk in one kernel; CPU reference at 32 nodes:
#       tau 2.05 -> 2.40 against the walk by samples), beside fa3tree-fast's T = 1 rows
step fa3tree-rrs 600 env DFLASH_TREE_FAST_ACCEPT=1 DFLASH_TREE_RRS=1 DFLASH_TREE_FA3_GRAPH=1 \
    DFLASH_TREE_KERNELS=$B python3 \
    benchmarks/gpu_engines.py run --engine sglang --mode tree --num-spec-tokens 32 \
    --attention-backend fa3 --no-prefill-graphs --concurrency 1 4 8 --temperatures 1 \
    --out "$E/sglang-tree32-fa3-rrs-t1.json"
# 0ft1. the T = 1 statistics of both fast walks (fa3tree-fast above times T = 1 since
#       2026-12-05; 2026-12-04 with SGLang's acceptance: 1.08x DFLASH at 1 request):
#       4 prompts x 2,000 completions each against plain's, on CPU afterwards:
#       python benchmarks/gpu_sampling.py compare $R/gpu-sampling/tree-rrs.json $R/gpu-sampling/plain.json
for m in plain tree-rrs tree-fast; do
  case $m in
    plain) a=(--mode plain) ;;
    tree-rrs) a=(--mode tree --num-spec-tokens 32 --attention-backend fa3 --concurrency 8) ;;
    tree-fast) a=(--mode tree --num-spec-tokens 32 --attention-backend fa3) ;;
  esac  # tree-rrs: rounds of more than 8 requests walk by samples (sglang_tree_rrs.MAX_BS)
  step sampling-$m 400 env DFLASH_TREE_FAST_ACCEPT=1 DFLASH_TREE_RRS=$([ $m = tree-rrs ] && \
      echo 1 || echo 0) DFLASH_TREE_FA3_GRAPH=1 DFLASH_TREE_KERNELS=$B python3 \
      benchmarks/gpu_sampling.py run --engine sglang "${a[@]}" --no-prefill-graphs \
      --out "$R/gpu-sampling/$m.json"
done
# 0t1. T = 1 with fa3 verifying the tree (SGLang's acceptance), then DFLASH at T = 1
step fa3tree-t1 600 python3 benchmarks/gpu_engines.py run --engine sglang --mode tree \
    --num-spec-tokens 32 --attention-backend fa3 --no-prefill-graphs --concurrency 1 4 8 \
    --temperatures 1 --out "$E/sglang-tree32-fa3-t1.json"
# 0t1b. smaller trees at T = 1: the walk's tau hardly grows past 8 nodes there (reference loop,
#      CPU: 2.01-2.05 over 8-256 nodes), so a narrower verify may beat 32 nodes' 1.08x DFLASH
for n in 8 16; do
  step fa3tree$n-t1 600 python3 benchmarks/gpu_engines.py run --engine sglang --mode tree \
      --num-spec-tokens $n --attention-backend fa3 --no-prefill-graphs --concurrency 1 4 8 \
      --temperatures 1 --out "$E/sglang-tree$n-fa3-t1.json"
done
step engines-dflash-t1 600 python3 benchmarks/gpu_engines.py run --engine sglang --mode dflash \
    --no-prefill-graphs --temperatures 1 --concurrency 1 4 8 --out "$E/sglang-dflash-t1.json"
# 0s. lossless at T = 1, by statistics: 4 prompts x 2,000 sampled completions of 6 tokens per
#     mode (plain twice: the test's own false-positive check); on CPU afterwards:
#     python benchmarks/gpu_sampling.py compare $R/gpu-sampling/tree-fa3.json $R/gpu-sampling/plain.json
for m in plain2 tree-fa3 tree dflash; do
  case $m in
    plain2) a=(--mode plain --seed 1) ;;  # same seed and order: the same random numbers
    tree-fa3) a=(--mode tree --num-spec-tokens 32 --attention-backend fa3) ;;
    tree) a=(--mode tree --num-spec-tokens 32 --draft-attention-backend fa3) ;;
    dflash) a=(--mode dflash) ;;
  esac
  step sampling-$m 400 python3 benchmarks/gpu_sampling.py run --engine sglang "${a[@]}" \
      --no-prefill-graphs --out "$R/gpu-sampling/$m.json"
done
# 1-. DFLASH_TREE without the scheduler's per-round wait for host lengths (DFLASH_TREE_LATE_SEQ_LENS=1,
#    sglang_tree_seqlens.py; never run on a GPU): checked first (each read compared with the
#    device lengths; raises inside the server), then the 8B-shape round (2026-12-04 with the host
#    plan and the fa3 drafter: 8.76 ms, 7.75 ms of kernels) and the harness rows beside DFLASH
#    (check the T = 0 outputs with greedy_margins.py on CPU)
step lateseq-check 600 env DFLASH_TREE_LATE_SEQ_LENS=1 DFLASH_TREE_LATE_SEQ_LENS_CHECK=1 \
    python3 benchmarks/gpu_engines.py run --engine sglang --mode tree --num-spec-tokens 32 \
    --no-prefill-graphs --draft-attention-backend fa3 --num-prompts 8 --max-tokens 64 \
    --concurrency 1 4 --temperatures 0 --out "$E/sglang-tree32-lateseq-check.json"
if failed lateseq-check; then
  echo "late seq lens failed their check: their timed steps skipped" | tee -a "$R/queue.log"
else
  step kernels-tree-lateseq-8b 400 env DFLASH_TREE_LATE_SEQ_LENS=1 python3 \
      benchmarks/gpu_engines.py round-cost --engine sglang --mode tree --num-spec-tokens 32 \
      --no-prefill-graphs --shape qwen3-8b --draft-attention-backend fa3 \
      --kernel-trace /tmp/traces/tree-lateseq --out "$E/kernels-sglang-tree-lateseq-8b.json"
  step engines-tree32-lateseq 600 env DFLASH_TREE_LATE_SEQ_LENS=1 python3 \
      benchmarks/gpu_engines.py run --engine sglang --mode tree --num-spec-tokens 32 \
      --no-prefill-graphs --temperatures 0 --draft-attention-backend fa3 --concurrency 1 4 8 \
      --out "$E/sglang-tree32-lateseq.json"
fi
# 1a. the tree round at the 8B shape with the drafter on fa3 (its TARGET_VERIFY replays then skip
#     flashinfer's host-copying plan, per 0.5.16's source): 2026-12-03 the flashinfer-drafter
#     round was 7.74 ms of kernels + 2.15 ms of idle GPU (DFLASH: 6.50 + 0.04); kernel table too
step kernels-tree-fa3draft-8b 400 python3 benchmarks/gpu_engines.py round-cost --engine sglang \
    --mode tree --num-spec-tokens 32 --no-prefill-graphs --shape qwen3-8b \
    --draft-attention-backend fa3 --kernel-trace /tmp/traces/tree-fa3draft \
    --out "$E/kernels-sglang-tree-fa3draft-8b.json"
# 1a'. the sync-free tree-verify plan (sglang_tree_plan.py; on by default since 2026-12-04, when
#     these steps ran: check passed, 8B round 9.23 / 8.76 ms with the flashinfer / fa3 drafter):
#     first with every replay's layout and packed mask compared to flashinfer's own
#     (CHECK=1 raises inside the server on a difference; timings void), then timed at the 8B
#     shape (alone and with the fa3 drafter) and in the warmed harness at T = 0 (check its
#     outputs with greedy_margins.py on CPU)
step hostplan-check 600 env DFLASH_TREE_HOST_PLAN=1 DFLASH_TREE_HOST_PLAN_CHECK=1 \
    python3 benchmarks/gpu_engines.py run --engine sglang --mode tree --num-spec-tokens 32 \
    --no-prefill-graphs --num-prompts 8 --max-tokens 64 --concurrency 1 4 --temperatures 0 \
    --out "$E/sglang-tree32-hostplan-check.json"
if failed hostplan-check; then
  echo "host plan failed its check: its timed steps skipped" | tee -a "$R/queue.log"
else
  for d in flashinfer fa3; do
    step kernels-tree-hostplan-$d-8b 400 env DFLASH_TREE_HOST_PLAN=1 python3 \
        benchmarks/gpu_engines.py round-cost --engine sglang --mode tree --num-spec-tokens 32 \
        --no-prefill-graphs --shape qwen3-8b --draft-attention-backend $d \
        --kernel-trace /tmp/traces/tree-hostplan-$d --out "$E/kernels-sglang-tree-hostplan-$d-8b.json"
  done
  step engines-tree32-hostplan 600 env DFLASH_TREE_HOST_PLAN=1 python3 benchmarks/gpu_engines.py \
      run --engine sglang --mode tree --num-spec-tokens 32 --no-prefill-graphs --temperatures 0 \
      --draft-attention-backend fa3 --concurrency 1 4 8 --out "$E/sglang-tree32-hostplan.json"
fi
# 1a''. DFLASH in the same harness and session as 1a' (its last row there is of 2026-12-01)
step engines-dflash 600 python3 benchmarks/gpu_engines.py run --engine sglang --mode dflash \
    --no-prefill-graphs --temperatures 0 --concurrency 1 4 8 --out "$E/sglang-dflash.json"
# 1b. the 8B-shape rounds of step 5 kernel by kernel (SGLang's torch profiler, 20 decode steps;
#     ran 2026-12-03, BENCHMARKS.md): tree, DFLASH and plain at the 8B shape; tables in the
#     JSONs, traces left in /tmp/traces
for m in tree dflash plain; do
  step kernels-$m-8b 400 python3 benchmarks/gpu_engines.py round-cost --engine sglang --mode $m \
      --num-spec-tokens $([ $m = tree ] && echo 32 || echo 15) --no-prefill-graphs \
      --shape qwen3-8b --kernel-trace /tmp/traces/$m --out "$E/kernels-sglang-$m-8b.json"
done
# 1c. the adaptive server as a whole at the Qwen3-8B shape (random weights, tau ~ 1: it should
#     take plain steps and probe q = 16 now and then) beside plain SGLang: within 3 % of plain?
#     (2026-12-03, before StepClock: 0.93 / 0.93 / 0.79 / 0.36x plain; 2026-12-04 with it:
#     0.958 / 0.950 / 0.965 / 0.533x, at 64 one bad plain sample: `cap_plain` since, re-run)
#     (both plain-step cuts of 2026-12-06 off, as then; the held appends are on by default since)
step adaptive-8b 600 env DFLASH_ADAPTIVE_DEFER_APPEND=0 DFLASH_ADAPTIVE_PLAIN_ATTENTION=0 python3 benchmarks/gpu_adaptive_sglang.py all --shape qwen3-8b \
    --modes plain,adaptive --concurrency 1,4,16,64 --out "$R/gpu-adaptive-sglang-8b" \
    --config benchmarks/results/gpu-engines/tune-sglang.json
# 1b. the same with the q = 1 steps' drafter-context appends held and written together
#     (DFLASH_ADAPTIVE_DEFER_APPEND, never run on a GPU); compare with adaptive-8b's rows
step adaptive-8b-defer 600 env DFLASH_ADAPTIVE_DEFER_APPEND=1024 DFLASH_ADAPTIVE_PLAIN_ATTENTION=0 \
    python3 \
    benchmarks/gpu_adaptive_sglang.py all --shape qwen3-8b --modes plain,adaptive \
    --concurrency 1,4,16,64 --out "$R/gpu-adaptive-sglang-8b-defer" \
    --config benchmarks/results/gpu-engines/tune-sglang.json
# 1c. the same with every prompt cut to its last 16 tokens: the rows are then decode steps
#     (the dev prompts average 362 tokens, so at 64 requests about half of a row is prefill);
#     if 1b misses 0.97 and 1c does not, the gap is in the prefill, else in the decode steps
step adaptive-8b-short 600 env DFLASH_ADAPTIVE_DEFER_APPEND=1024 DFLASH_ADAPTIVE_PLAIN_ATTENTION=0 \
    python3 \
    benchmarks/gpu_adaptive_sglang.py all --shape qwen3-8b --modes plain,adaptive \
    --concurrency 1,4,16,64 --prompt-tokens 16 --out "$R/gpu-adaptive-sglang-8b-short" \
    --config benchmarks/results/gpu-engines/tune-sglang.json
# 1d. a plain step inside the DFLASH worker (q = 1) kernel by kernel beside SGLang's own plain
#     step, 8B shape, 1 request, 1k prompt (GPU busy / idle time and who waited in `timeline`):
#     whether the 2-3 % a q = 1 step costs over plain is GPU work (which kernels) or host gaps;
#     the q = 1 step with the appends held too (the traced steps then append nothing)
step kernels-plain-8b 400 python3 benchmarks/gpu_engines.py round-cost --engine sglang \
    --mode plain --no-prefill-graphs --shape qwen3-8b --kernel-trace /tmp/traces/plain \
    --out "$E/kernels-sglang-plain-8b.json"
step kernels-q1-8b 400 env DFLASH_ADAPTIVE_DEFER_APPEND=0 DFLASH_ADAPTIVE_PLAIN_ATTENTION=0 python3 benchmarks/gpu_engines.py round-cost --engine sglang \
    --mode adaptive-q1 --no-prefill-graphs --shape qwen3-8b --kernel-trace /tmp/traces/q1 \
    --out "$E/kernels-sglang-q1-8b.json"
step kernels-q1-defer-8b 400 env DFLASH_ADAPTIVE_DEFER_APPEND=1024 DFLASH_ADAPTIVE_PLAIN_ATTENTION=0 \
    python3 \
    benchmarks/gpu_engines.py round-cost --engine sglang --mode adaptive-q1 --no-prefill-graphs \
    --shape qwen3-8b --kernel-trace /tmp/traces/q1-defer --out "$E/kernels-sglang-q1-defer-8b.json"
# 1e. the same at 64 requests (64 copies of a 128-token prompt decoding together: one prefill
#     chunk): on the H100 (2026-12-06) the adaptive server's plain steps were 0.977x plain at 1,
#     4 and 16 requests and 0.954x at 64; at 1 request the q = 1 step's extra GPU work was FA3's
#     per-layer scheduling kernel (36 calls, 121 us) and a slower verify-mode attention (+49 us)
step kernels-plain-8b-b64 400 python3 benchmarks/gpu_engines.py round-cost --engine sglang \
    --mode plain --no-prefill-graphs --shape qwen3-8b --batch 64 --prompt-tokens 128 \
    --kernel-trace /tmp/traces/plain-b64 --out "$E/kernels-sglang-plain-8b-b64.json"
step kernels-q1-defer-8b-b64 400 env DFLASH_ADAPTIVE_DEFER_APPEND=1024 DFLASH_ADAPTIVE_PLAIN_ATTENTION=0 \
    python3 \
    benchmarks/gpu_engines.py round-cost --engine sglang --mode adaptive-q1 --no-prefill-graphs \
    --shape qwen3-8b --batch 64 --prompt-tokens 128 --kernel-trace /tmp/traces/q1-defer-b64 \
    --out "$E/kernels-sglang-q1-defer-8b-b64.json"
# 1f. the q = 1 step attending as SGLang's plain decode step (DFLASH_ADAPTIVE_PLAIN_ATTENTION=1,
#     `engines/sglang_plain_attention.py`: FA3's decode path with its schedule computed once per
#     step; never run on a GPU yet): kernels at 1 and 64 requests, then the server's rows
#     (token identity with plain is the rows' own check)
P="env DFLASH_ADAPTIVE_DEFER_APPEND=1024 DFLASH_ADAPTIVE_PLAIN_ATTENTION=1"
step kernels-q1-plainattn-8b 400 $P python3 benchmarks/gpu_engines.py round-cost \
    --engine sglang --mode adaptive-q1 --no-prefill-graphs --shape qwen3-8b \
    --kernel-trace /tmp/traces/q1-plainattn --out "$E/kernels-sglang-q1-plainattn-8b.json"
step kernels-q1-plainattn-8b-b64 400 $P python3 benchmarks/gpu_engines.py round-cost \
    --engine sglang --mode adaptive-q1 --no-prefill-graphs --shape qwen3-8b --batch 64 \
    --prompt-tokens 128 --kernel-trace /tmp/traces/q1-plainattn-b64 \
    --out "$E/kernels-sglang-q1-plainattn-8b-b64.json"
step adaptive-8b-plainattn 600 $P python3 benchmarks/gpu_adaptive_sglang.py all \
    --shape qwen3-8b --modes plain,adaptive --concurrency 1,4,16,64 \
    --out "$R/gpu-adaptive-sglang-8b-plainattn" \
    --config benchmarks/results/gpu-engines/tune-sglang.json
# 1g. (2026-12-06 afternoon) both cuts on by default now. 1f ran: the q = 1 step's kernels equal
#     plain's (7,545 / 7,539 us at 64 requests), yet the rows were 0.985 / 0.984 / 0.938 / 0.964x
#     plain with one 4-second window each (16 requests: 0.975 that morning). The same rows three
#     times each on one server (median, range; SGLang's "Decode batch" lines in both logs: decode
#     throughput and CUDA-graph use per 40 steps), then where the 64-request row's time goes
#     (the stack sampler on plain and adaptive, `breakdown`)
step adaptive-8b-rep 600 python3 benchmarks/gpu_adaptive_sglang.py all --shape qwen3-8b \
    --modes plain,adaptive --concurrency 4,16,64 --repeats 3 --log-level info \
    --out "$R/gpu-adaptive-sglang-8b-rep" \
    --config benchmarks/results/gpu-engines/tune-sglang.json
# 1h. (2026-12-06 evening) the fixture with drafts accepted ran q = 16 steps slower in every
#     server with DFLASH_ADAPTIVE_PLAIN_ATTENTION=1 (4 servers) than in both without (2), though
#     only q = 1 steps use its backend; off by default since. Four adaptive servers in turn,
#     on / off / on / off (held appends on in all), at 16 and 64 requests, 3 times each, SGLang's
#     info log (its decode lines, our start-up line and the policy's line every 200 steps with
#     the allocator's retries and free memory): a cause, or chance
step plainattn-ab 600 bash -c 'for p in 1 0 1 0; do n=$((n + 1)); \
    DFLASH_ADAPTIVE_PLAIN_ATTENTION=$p python3 benchmarks/gpu_adaptive_sglang.py all \
    --modes adaptive --concurrency 16,64 --repeats 3 --log-level info \
    --out "$0/gpu-adaptive-sglang-plainattn-ab/$n-pa$p" \
    --config benchmarks/results/gpu-engines/tune-sglang.json; done' "$R"
step profile-8b-64 600 python3 benchmarks/gpu_adaptive_sglang.py profile --shape qwen3-8b \
    --modes plain,adaptive --concurrency 16,64 --requests-per-slot 8 \
    --out "$R/gpu-adaptive-sglang-8b-profile" \
    --config benchmarks/results/gpu-engines/tune-sglang.json
# 1i. (2026-12-06 night) DFLASH's prefill waits for the GPU (`torch.tensor(list, device=cuda)`
#     in its extend branch); DFLASH_ASYNC_PREFILL (default on) prefills without that sync. Ran
#     once that night with every request 128 tokens (requests in waves, a few prefills per row):
#     no change (BENCHMARKS.md). Now with staggered output lengths (64-192 tokens: a request
#     finishes, and one is prefilled, every few steps): the GPU check that the copy does not
#     sync, plain and adaptive at the 8B shape, then adaptive with it off
step async-prefill-8b 600 bash -c 'python3 -m pytest -q -m gpu tests/engines/test_sglang_prefill.py \
    -p no:cacheprovider; O="$0/gpu-adaptive-sglang-8b-asyncprefill"; \
    A="--shape qwen3-8b --concurrency 16,64 --repeats 3 --length-spread 0.5 --waves 4"; \
    python3 benchmarks/gpu_adaptive_sglang.py all $A --modes plain,adaptive --log-level info \
    --out "$O/on" --config benchmarks/results/gpu-engines/tune-sglang.json; \
    DFLASH_ASYNC_PREFILL=0 python3 benchmarks/gpu_adaptive_sglang.py all $A --modes adaptive \
    --log-level info --out "$O/off" --config benchmarks/results/gpu-engines/tune-sglang.json' "$R"
# 1j. DFLASH_TREE prefills through DFLASH_ASYNC_PREFILL (default on since 2026-12-06 night) and
#     had no GPU run with it: its T = 0 outputs beside plain SGLang's on the same prompts
#     (`report`'s identity column; a difference is checked with greedy_margins.py on CPU)
step tree-asyncprefill 600 bash -c 'A="--no-prefill-graphs --num-prompts 16 --max-tokens 128 \
    --concurrency 1 8 --temperatures 0"; D="$0/tree-asyncprefill"; \
    python3 benchmarks/gpu_engines.py run --engine sglang --mode plain $A --out "$D/plain.json"; \
    python3 benchmarks/gpu_engines.py run --engine sglang --mode tree --num-spec-tokens 32 $A \
    --out "$D/tree32.json"; python3 benchmarks/gpu_engines.py report --inputs "$D/plain.json" "$D/tree32.json" \
    --out-md "$D/report.md"' "$E"
# 1l. DFLASH_FAST_DECODE_PREP (`engines/sglang_decode_prep.py`, never run on a GPU; off by
#     default): DFLASH's per-step `prepare_for_decode` without its five fresh length buffers and
#     its per-request tensor writes (CPU host: 35-73 against 109-349 us per call at 16-64
#     requests; H100 host 2026-12-06 afternoon, `decode-prep-bench`: 107 / 142 / 214 against
#     372 / 638 / 1,196 us). Its host time per call beside DFLASH's on this host (seconds), the
#     fixture's adaptive server in check mode (DFLASH's method runs every step and is compared;
#     a difference raises in the server), then adaptive servers off / on / off / on at 16, 32
#     and 64 requests, 3 repeats each (the 32-request row is the one under the goal). Ran
#     2026-12-06 evening: the check passed at 1 and 32 requests; on / off within the spread
step decode-prep-bench 120 python3 benchmarks/decode_prep_bench.py --device cuda \
    --out "$R/decode-prep/bench.json"
step decode-prep-check 400 env DFLASH_FAST_DECODE_PREP=check python3 \
    benchmarks/gpu_adaptive_sglang.py all --modes adaptive --concurrency 1,32 \
    --out "$R/decode-prep/check" --config benchmarks/results/gpu-engines/tune-sglang.json
if failed decode-prep-check; then
  echo "fast decode prep failed its check: its timed step skipped" | tee -a "$R/queue.log"
else
  step decode-prep-ab 600 bash -c 'for p in 0 1 0 1; do n=$((n + 1)); \
      DFLASH_FAST_DECODE_PREP=$p python3 benchmarks/gpu_adaptive_sglang.py all \
      --modes adaptive --concurrency 16,32,64 --repeats 3 --out "$0/decode-prep/$n-fp$p" \
      --config benchmarks/results/gpu-engines/tune-sglang.json; done' "$R"
fi
# 1m. DFLASH_BATCH_ADMISSION (`engines/sglang_admission.py`, never run on a GPU; off by
#     default): new prefills held (at most K passes) until K requests wait, below full load too
#     (SGLang holds DFLASH's only at full load). The fixture's 32-request row had about one
#     prefill pass per decode step and was the one under the goal; 64 of 64 (SGLang's hold
#     active) met it. Adaptive servers off / auto / off / auto at 16, 32 and 64 requests, 3
#     repeats each, SGLang's info log (the prefill lines show the admissions' sizes). Not run:
#     admission-goal (below) ran instead, 2026-12-06 evening: no gain beyond the starts' spread
step admission-ab 600 bash -c 'for a in 0 auto 0 auto; do n=$((n + 1)); \
    DFLASH_BATCH_ADMISSION=$a python3 benchmarks/gpu_adaptive_sglang.py all --modes adaptive \
    --concurrency 16,32,64 --repeats 3 --log-level info --out "$0/admission/$n-$a" \
    --config benchmarks/results/gpu-engines/tune-sglang.json; done' "$R"
# 1n. (2026-12-06 evening) host-bound or GPU-bound at 32 requests? Neither switch above lifted
#     the fixture's 32-request row (BENCHMARKS.md "Batched admissions and the fast decode-step
#     preparation in the server"); every row's host record now carries the GPU's mean busy
#     share from the driver's samples (`bench/gpu_busy.py`), and the adaptive server's log line
#     its launch ledger (`adaptive.LaunchLedger`: mean ms and share of the wall time from a
#     decode to a decode, a decode to a prefill and a prefill to the next launch; requests per
#     prefill pass): what one admission pass costs its decode. First that NVML answers
#     (seconds), then the three servers at 16, 32 and 64 requests, 3 repeats, twice (about 500 s)
step gpu-busy-check 60 python3 -c "import sys; sys.path.insert(0, 'benchmarks'); \
from bench.gpu_busy import now_us, samples_since; s = samples_since(now_us() - 10**7); \
print(len(s) if s is not None else s, s[-3:] if s else ''); sys.exit(s is None)"
step busy-32 600 python3 benchmarks/gpu_adaptive_sglang.py all --starts 2 \
    --concurrency 16,32,64 --repeats 3 --out "$R/gpu-adaptive-sglang-busy" \
    --config benchmarks/results/gpu-engines/tune-sglang.json
# 1o. the same row with outputs of 64-192 tokens (`--length-spread 0.5`, requests finishing at
#     any step, as at the 8B shape, whose rows then moved by under 0.1 % between starts): are
#     the fixture's 32-request rows (up to +-12 % within one server) waves of equal-length
#     requests finishing together? plain and adaptive, two starts each (about 250 s)
step spread-32 400 python3 benchmarks/gpu_adaptive_sglang.py all --starts 2 --modes plain,adaptive \
    --concurrency 32 --repeats 3 --length-spread 0.5 --waves 4 --out "$R/gpu-adaptive-sglang-spread-32" \
    --config benchmarks/results/gpu-engines/tune-sglang.json
# 1p. DFLASH_PREFILL_APPEND (`engines/sglang_prefill_append.py`): the prompt's drafter-KV append
#     (7.2 % of the adaptive scheduler's samples at 32 requests, profile-32) through CUDA graphs
#     per token bucket. First `check` (DFLASH's flat append and the graphs' both, their K/V
#     compared at the prompt's slots; a mismatch raises in the scheduler; the log's "equal
#     DFLASH's" lines give the largest difference), then the host cuts together: adaptive
#     servers with DFLASH_PREFILL_APPEND and DFLASH_FAST_DECODE_PREP off / on / off / on at 16,
#     32 and 64 requests, 3 repeats, and one plain server for the hour's reference (about 70 +
#     460 s). Ran 2026-12-06 night (BENCHMARKS.md "Host cuts"): check passed, the cuts 14-29 %,
#     since then both on by default; the unit step failed on a test artefact (fixed, owed)
step prefill-append-unit 120 python3 -m pytest -q -m gpu tests/engines/test_sglang_prefill_append.py \
    -p no:cacheprovider
step prefill-append-check 300 env DFLASH_PREFILL_APPEND=check python3 \
    benchmarks/gpu_adaptive_sglang.py all --modes adaptive --concurrency 1,32 \
    --out "$R/prefill-append/check" --config benchmarks/results/gpu-engines/tune-sglang.json
if failed prefill-append-check; then
  echo "prefill append failed its check: its timed step skipped" | tee -a "$R/queue.log"
else
  step host-cuts-ab 600 bash -c 'for p in 0 1 0 1; do n=$((n + 1)); \
      DFLASH_PREFILL_APPEND=$p DFLASH_FAST_DECODE_PREP=$p python3 \
      benchmarks/gpu_adaptive_sglang.py all --modes adaptive --concurrency 16,32,64 \
      --repeats 3 --out "$0/host-cuts/$n-cuts$p" \
      --config benchmarks/results/gpu-engines/tune-sglang.json; done; \
      python3 benchmarks/gpu_adaptive_sglang.py all --modes plain --concurrency 16,32,64 \
      --repeats 3 --out "$0/host-cuts/5-plain" \
      --config benchmarks/results/gpu-engines/tune-sglang.json' "$R"
fi
# 1s. the goal's table with steady load: --waves 16 (512 requests per closed loop at 32, not
#     64). A row's closed loop issues waves x c requests and then drains: its last requests run
#     with ever fewer beside them. Plain SGLang's equal-length requests start and finish
#     together, so its loops drain at once; the DFLASH family's finish at different steps
#     (acceptance differs), so each loop ends in a tail of small batches. In the spread-32 row
#     (2026-12-06 night) the adaptive server's launch ledger accounts for about 3.2 ms per
#     decode step, which at the row's 29,000-30,500 tok/s and 4.4 tokens per request per step
#     means about 22 requests per decode step, not 32. With 16 waves the tail is about a
#     sixteenth of the loop. Plain, DFLASH and adaptive at 1-64 requests (about 420 s); the
#     ledger's `per_decode` gives the adaptive server's mean decode batch
step goal-steady 600 python3 benchmarks/gpu_adaptive_sglang.py all --waves 16 \
    --modes plain,dflash,adaptive --out "$R/goal-steady" \
    --config benchmarks/results/gpu-engines/tune-sglang.json
# 1t. (ran 2026-12-06 late, BENCHMARKS.md "Steady load": goal-steady left the 32 row at 0.886x;
#     servers started for 32 requests alone made 31,210 tok/s against 21,058-28,471 in the
#     sweeps; the ledger: a server whose running limit is 64 (the sweep's) admits 1.5-1.6
#     requests per prefill pass at 32 requests, 128-141 passes per 200 decode steps, 4.9-7.0 ms
#     per decode step; one whose limit is 32 is held by SGLang's DFLASH rule (a prefill waits
#     for 4 free slots) and admits 4.4-4.9 per pass, 42-45 passes, 3.6-3.9 ms. Since then rows
#     run 16 waves by default.) Next:
#     solo-32: plain, DFLASH and adaptive each started for 32 requests alone (limit 32), 3
#       repeats: DFLASH under the same SGLang rule was not measured there (about 250 s);
#     steady-admission: DFLASH_BATCH_ADMISSION=0 / auto (4 at this limit) / cost (K from the
#       server's ledger, `admission.hold_size`) on adaptive servers of the sweep's limit (64)
#       at 16, 32 and 64 requests, 2 repeats, then plain (steady-admission-8: K = 8 likewise):
#       does our hold give the limit-32 servers' batching at any limit? (at 2 waves it did not
#       show, 2026-12-06 evening, but neither did SGLang's own rule: 23,703 tok/s). 8: with a
#       pass costing about 6 ms beside 2.5-ms decode steps and 1.1 admissions per step at 32
#       requests, (2.5 + 1.1 x 6 / K) / (32 - (K - 1) / 2) ms per request-step is least near
#       K = 10 (0.284 at K = 1, 0.136 at 4, 0.117 at 8, 0.115 at 10; arithmetic, not measured;
#       `cost` takes the smallest K within 3 % of the best: 8 there); about 400 s;
#     goal-adm: the goal's table with DFLASH_BATCH_ADMISSION=$ADM (default cost; ADM=auto if
#       steady-admission favours it; about 320 s; adaptive first, so that a run cut short by the
#       device's time keeps the row in question)
step solo-32 400 python3 benchmarks/gpu_adaptive_sglang.py all --modes plain,dflash,adaptive \
    --concurrency 32 --repeats 3 --out "$R/solo-32" \
    --config benchmarks/results/gpu-engines/tune-sglang.json
step steady-admission 600 bash -c 'for a in 0 auto cost; do n=$((n + 1)); \
    DFLASH_BATCH_ADMISSION=$a python3 benchmarks/gpu_adaptive_sglang.py all --modes adaptive \
    --concurrency 16,32,64 --repeats 2 --out "$0/steady-admission/$n-$a" \
    --config benchmarks/results/gpu-engines/tune-sglang.json; done; \
    python3 benchmarks/gpu_adaptive_sglang.py all --modes plain --concurrency 16,32,64 \
    --repeats 2 --out "$0/steady-admission/4-plain" \
    --config benchmarks/results/gpu-engines/tune-sglang.json' "$R"
step steady-admission-8 300 env DFLASH_BATCH_ADMISSION=8 python3 \
    benchmarks/gpu_adaptive_sglang.py all --modes adaptive --concurrency 16,32,64 --repeats 2 \
    --out "$R/steady-admission-8" --config benchmarks/results/gpu-engines/tune-sglang.json
step goal-adm 600 env DFLASH_BATCH_ADMISSION=${ADM:-cost} python3 benchmarks/gpu_adaptive_sglang.py all \
    --modes adaptive,plain,dflash --out "$R/goal-adm" \
    --config benchmarks/results/gpu-engines/tune-sglang.json
# 1q. the goal's table at the defaults with the host cuts (on by default since 2026-12-06 night):
#     plain, DFLASH and adaptive at 1-64 requests, one start each, outputs of 128 tokens, then
#     of 64-192 tokens (the 32-request row at equal lengths is plain's best case: its requests
#     finish in waves; with spread lengths plain made 14,015 tok/s there, adaptive 27,815);
#     about 420 s each
step goal-cuts 600 python3 benchmarks/gpu_adaptive_sglang.py all --modes plain,dflash,adaptive \
    --out "$R/goal-cuts" --config benchmarks/results/gpu-engines/tune-sglang.json
step goal-cuts-spread 600 python3 benchmarks/gpu_adaptive_sglang.py all \
    --modes plain,dflash,adaptive --length-spread 0.5 --waves 4 --out "$R/goal-cuts-spread" \
    --config benchmarks/results/gpu-engines/tune-sglang.json
# 1r. the same table with --context-length 4096 (the fixture's own limit): SGLang caps its
#     prefill CUDA graphs at the context length, and at 2048 every prefill pass of more tokens
#     ran eagerly (profile-32's info log: 37 of 147 passes, all over 2,048 tokens; the adaptive
#     server admits 3.5 prompts of 362 tokens per pass on average); about 450 s
step goal-ctx4096 600 python3 benchmarks/gpu_adaptive_sglang.py all --context-length 4096 \
    --modes plain,dflash,adaptive --out "$R/goal-ctx4096" \
    --config benchmarks/results/gpu-engines/tune-sglang.json
# 1m'. the goal's table with DFLASH_BATCH_ADMISSION=auto: plain, DFLASH and adaptive (the hook
#      passes plain's and DFLASH's schedulers through) at every concurrency, then adaptive off /
#      auto with SGLang's info log (the prefill lines count the admissions); about 420 s
step admission-goal 600 bash -c 'DFLASH_BATCH_ADMISSION=auto python3 \
    benchmarks/gpu_adaptive_sglang.py all --modes plain,dflash,adaptive --out "$0/admgoal/1-auto" \
    --config benchmarks/results/gpu-engines/tune-sglang.json; for a in 0 auto; do n=$((n + 1)); \
    DFLASH_BATCH_ADMISSION=$a python3 benchmarks/gpu_adaptive_sglang.py all --modes adaptive \
    --log-level info --out "$0/admgoal/$((n + 1))-$a" \
    --config benchmarks/results/gpu-engines/tune-sglang.json; done' "$R"
# 1k. (2026-12-06 afternoon) the fixture at 32 requests: plain SGLang 24,984-25,628 tok/s, DFLASH
#     19,712-20,153, adaptive 21,056-22,314 (0.82-0.89x max). The adaptive server's steady
#     steps at 32 are 2.07 (q = 1) and 2.67 ms (q = 16, tau 4.36): 52k tok/s if every step were
#     one of them, so about 60 % of its time is elsewhere (prefills, steps after a batch change).
#     Where: the scheduler sampled in each server, DFLASH's too (then `breakdown` on CPU),
#     SGLang's info log (each prefill batch: its requests, tokens and whether its CUDA graph
#     ran). (The profile
#     of 2026-12-03 had DFLASH's target prefill eager in 22 % of its samples at 16 requests: the
#     one-character prompts of that day, padded past the prefill graphs' factor 2; with the dev
#     prompts the prefill graphs run up to 2,038 tokens, 2026-12-06 logs)
step profile-32 500 python3 benchmarks/gpu_adaptive_sglang.py profile \
    --modes plain,dflash,adaptive --concurrency 32 --requests-per-slot 8 --log-level info \
    --out "$R/gpu-adaptive-sglang-profile-32" \
    --config benchmarks/results/gpu-engines/tune-sglang.json
# 2. issue 20 in SGLang: one engine per k, the best k per concurrency
step tune-sglang 600 python3 -m dflash_plugin.cli tune --engine sglang \
    --target examples/fixtures/code-target --draft examples/fixtures/code-target-dflash-b16 \
    --prompts examples/fixtures/dev-prompts.jsonl --candidates 0,7,15 \
    --concurrency 1,4,8,16,32,64 --max-new-tokens 128 --dtype bfloat16 --out "$E/tune-sglang.json"
# 2b. issue 20 in SGLang, per step: one DFLASH_ADAPTIVE server (block length chosen per step from
#     tune-sglang.json's step times, then its own) beside plain and fixed DFLASH, 1-64 requests,
#     then a moving load on each warm server (phases CxN back to back); the dev prompts since
#     ef67f7e (before it: one-character prompts, BENCHMARKS.md)
step adaptive 900 python3 benchmarks/gpu_adaptive_sglang.py all --out "$R/gpu-adaptive-sglang" \
    --config benchmarks/results/gpu-engines/tune-sglang.json \
    --trace 1x16,64x512,4x64,32x256,1x16
# 2b+. the same with every row three times (median, range), the defaults of the day (ran
#      2026-12-06 evening with both plain-step cuts on: lossless, 0.68-0.84x max at 8-64; due
#      again with the plain-step attention off, its default since) (no moving load: with it the
#      step would pass the device's 10 minutes per call)
step adaptive-rep 900 python3 benchmarks/gpu_adaptive_sglang.py all --repeats 3 \
    --out "$R/gpu-adaptive-sglang-rep" --config benchmarks/results/gpu-engines/tune-sglang.json
# 2b++. the same with each mode's server started twice, the modes in turn (`--starts 2`: the
#       median start per row, the range over both): the fixture's rows moved by up to 40 % from
#       one server start to the next (DFLASH at 64 requests 28,508 / 20,225 tok/s, 2026-12-06),
#       more than the differences the goal is about. Ran that night (543 s): up to 70 % apart
#       between starts, inconclusive; again now that each server's cores and CPU use are kept
step adaptive-starts 600 python3 benchmarks/gpu_adaptive_sglang.py all --starts 2 \
    --out "$R/gpu-adaptive-sglang-starts" --config benchmarks/results/gpu-engines/tune-sglang.json
# 2b'. the same three servers timed at T = 1 (never run: DFLASH's sampled verify with q = 1 is
#     new ground for the worker), fixture, dev prompts
step adaptive-t1 900 python3 benchmarks/gpu_adaptive_sglang.py all --temperature 1 \
    --concurrency 1,4,16,64 --out "$R/gpu-adaptive-sglang-t1" \
    --config benchmarks/results/gpu-engines/tune-sglang.json
# 2c. what a plain step costs inside the DFLASH worker (every step q = 1) beside SGLang's plain
step adaptive-q1 600 python3 benchmarks/gpu_adaptive_sglang.py all --modes plain,adaptive-q1 \
    --out "$R/gpu-adaptive-sglang-q1" --config benchmarks/results/gpu-engines/tune-sglang.json
# 2d. where a decode step's host time goes: SGLang's scheduler loop sampled (stack_sampler) in
#     plain SGLang, DFLASH_ADAPTIVE with every step q = 1, fixed DFLASH; 1, 16 and 64 requests
step profile-q1 600 python3 benchmarks/gpu_adaptive_sglang.py profile \
    --modes plain,adaptive-q1,dflash --concurrency 1,16,64 --out "$R/gpu-adaptive-sglang-profile" \
    --config benchmarks/results/gpu-engines/tune-sglang.json
# 2e. the same at the Qwen3-8B shape (random weights, tau ~ 1): does the GPU hide the host work
#     there, and the step times of q = 1 and q = 16 per batch size (the cost model's T(q, bs))
step profile-8b 600 python3 benchmarks/gpu_adaptive_sglang.py profile --shape qwen3-8b \
    --modes plain,adaptive-q1,dflash --concurrency 1,4,16,64 --requests-per-slot 4 \
    --out "$R/gpu-adaptive-sglang-profile-8b" \
    --config benchmarks/results/gpu-engines/tune-sglang.json
# 3. Spiffy at 8 requests: with the draft-row K/V copy (SPIFFY_COPY_DRAFT_KV=1) one token was
#    4.15 nats off one-step decoding (2026-12-01 and -02), without it (now the default) none. Rows:
#    the default with graphs, graphs off (flashinfer: fa3 cannot run dLLMs eagerly), the copy
#    again; check on CPU: `greedy_margins.py --target examples/fixtures/code-dllm --runs $D/*.json`
W=${W:-/tmp/dllm-work}; D=$R/gpu-dllm
step dllm-prepare 120 python3 benchmarks/gpu_dllm.py prepare --work "$W"
step dllm-spiffy 300 python3 benchmarks/gpu_dllm.py run --work "$W" --algorithm Spiffy \
    --out "$D/spiffy.json"
step dllm-spiffy-eager 300 python3 benchmarks/gpu_dllm.py run --work "$W" --algorithm Spiffy \
    --eager --out "$D/spiffy-eager.json"
step dllm-lowconf 300 python3 benchmarks/gpu_dllm.py run --work "$W" --algorithm LowConfidence \
    --out "$D/lowconf.json"
step dllm-lowconf-eager 300 python3 benchmarks/gpu_dllm.py run --work "$W" \
    --algorithm LowConfidence --eager --out "$D/lowconf-eager.json"
# 4. DFLASH_TREE in the warmed harness at T = 0 and 1, 32 nodes (64 in step 7; check T = 0 rows
#    with greedy_margins.py on CPU)
step engines-tree32 600 python3 benchmarks/gpu_engines.py run --engine sglang --mode tree \
    --num-spec-tokens 32 --no-prefill-graphs --out "$E/sglang-tree32.json"
# 5. the tree round at the Qwen3-8B shape (2026-12-02: tree 10.42 ms, DFLASH 6.52 ms, plain
#    5.12 ms; 2026-12-03: 10.94 ms, its profile lines lost to the Engine's log level, which
#    gpu_engines.py now sets to info with DFLASH_TREE_PROFILE), with the per-phase profile
step round-tree 400 env DFLASH_TREE_PROFILE=20 python3 benchmarks/gpu_engines.py round-cost --engine sglang --mode tree \
    --num-spec-tokens 32 --no-prefill-graphs --shape qwen3-8b --out "$E/round-sglang-tree.json"
# 5a. the verify cost of N nodes at the 8B shape (issue 19's table): 16 and 64 nodes beside step 5's 32
for n in 16 64; do
  step round-tree$n-8b 400 python3 benchmarks/gpu_engines.py round-cost --engine sglang --mode tree \
      --num-spec-tokens $n --no-prefill-graphs --shape qwen3-8b \
      --out "$E/round-sglang-tree$n-8b.json"
done
# 6. where a tree round's time goes (tree phase and drafter-KV append graphed, captured at start;
#    2026-12-02: every phase host-bound, the eager append 1.2 ms), 1 and 8 requests
step profile 300 env DFLASH_TREE_PROFILE=50 python3 $T run --mode tree32 --prompts 8 \
    --max-new-tokens 128 --out "$R/tree-graphs"
# 7. the same at 64 nodes
step engines-tree64 600 python3 benchmarks/gpu_engines.py run --engine sglang --mode tree \
    --num-spec-tokens 64 --no-prefill-graphs --out "$E/sglang-tree64.json"
# 8. the copy row again (off by default since 2026-12-02)
step dllm-spiffy-copy 300 env SPIFFY_COPY_DRAFT_KV=1 python3 benchmarks/gpu_dllm.py run \
    --work "$W" --algorithm Spiffy --out "$D/spiffy-copy.json"
echo "done at $(( $(date +%s) - t0 )) s" | tee -a "$R/queue.log"
