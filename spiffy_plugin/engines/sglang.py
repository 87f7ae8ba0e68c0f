"""SGLang adapter for Spiffy: a dLLM algorithm for `--dllm-algorithm Spiffy`.

SGLang's dLLM runtime denoises one *canvas* (the current block) per request; an algorithm's
`step` turns the canvas's logits into the next canvas. The *algorithm config* is the YAML file of
`--dllm-algorithm-config` (keys below). This module is import-free of SGLang: it validates
configs and registers the algorithms; the acceptance rule is `sglang_drafts.py`, the draft rows
`sglang_batch.py`, the SGLang class `sglang_algorithm.py` (imported lazily, inside SGLang).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from ..errors import ConfigError, env_flag, require, validated
from ..graph import DraftGraph, load_graph
from ..params import DecodeParams

FIELD = "--dllm-algorithm-config"
# SGLang stores temperature 0 as temperature 1 with top_k 1, and "no top_k" as 1 << 30.
TOP_K_ALL = 1 << 30


COPY_KV_ENV = "SPIFFY_COPY_DRAFT_KV"


def copy_draft_kv(environ=None) -> bool:
    """`SPIFFY_COPY_DRAFT_KV` (server environment): 0 (default) writes a finished block's K/V
    with one more forward (the one-step loop's own way); 1 lets a block whose last step a draft
    row verified take its final canvas's K/V from that row instead. Off by default since the
    H200 run of 2026-12-02 (SGLang 0.5.16, bf16, CUDA graphs, 8 requests): with the copy, one
    token of 2,048 was 4.15 nats off one-step decoding, twice in two runs; without it every token
    followed one-step decoding (at most 0.021, rounding) and the rows ran faster (340 / 607 vs
    261 / 490 tok/s at 1 / 8 requests). On SGLang's CPU server (fp32) both are exact. A clear
    error for other values."""
    import os

    return env_flag(os.environ if environ is None else environ, COPY_KV_ENV, "0",
                    "copy a verified draft row's K/V")


def rule_params(rule: str) -> DecodeParams:
    """DecodeParams of a graph's `rule` ("vanilla-S" or "threshold-T"), greedy."""
    kind, _, value = rule.partition("-")
    try:
        if kind == "vanilla":
            return DecodeParams(unmask_per_step=int(value))
        if kind == "threshold":
            return DecodeParams(threshold=float(value))
    except ValueError:
        pass
    raise ConfigError("graph.rule", f"expected 'vanilla-S' or 'threshold-T', got {rule!r}")


@dataclass(frozen=True)
class SpiffyConfig:
    graph: DraftGraph
    graph_path: str
    keep: int  # D*: draft nodes scored per forward after pruning
    params: DecodeParams  # the decoding rule (must be the one the graph was calibrated under)
    mask_id: int
    eos_token_id: int | None
    banned_token_ids: tuple[int, ...]  # never predicted (mask, pad)
    seed: int = 0  # YAML `seed`: random streams of sampled requests that give no sampling_seed

    @property
    def budget(self) -> int:  # D: nodes in the calibrated graph
        return len(self.graph.nodes)


class SpiffyYaml(BaseModel):
    """The keys of a Spiffy `--dllm-algorithm-config` YAML (types and ranges that need no graph;
    `spiffy_config` checks the rest against the graph file)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    graph: str | None = None  # the calibrated draft graph file (`spiffy calibrate --out`)
    budget: int | None = Field(None, ge=1)  # D, must equal the graph's node count
    keep: int | None = None  # D*, in [1, D]
    threshold: float | None = None  # must be the graph's rule
    unmask_per_step: int | None = Field(None, ge=1)  # must be the graph's rule
    eos_token_id: int | None = Field(None, ge=0)
    banned_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    max_running_requests: int | None = Field(None, ge=1)  # applied by `_apply_dllm_defaults`
    seed: int = Field(0, ge=0)
    block_size: Any = None  # SGLang's own keys (dllm/config.py, algorithm base)
    capture_input_preparation: Any = None


def read_yaml(raw: Any, schema: type[SpiffyYaml] = SpiffyYaml) -> SpiffyYaml:
    """The YAML mapping validated by `schema` (a `ConfigError` naming the key and range)."""
    require(isinstance(raw, dict), FIELD, f"must be a YAML mapping, got {type(raw).__name__}")
    return validated(schema, f"{FIELD}: ", **raw)


def spiffy_config(y: SpiffyYaml, *, block_size: int, mask_id: int) -> SpiffyConfig:
    """The checks against the graph file, and the config they give."""
    require(y.graph is not None, f"{FIELD}: graph",
            "required: the calibrated draft graph file (`spiffy calibrate --out`)")
    graph = load_graph(Path(y.graph).expanduser())
    d = len(graph.nodes)
    require(d >= 1, f"{FIELD}: graph", "the graph has no nodes")
    require(graph.block_size == block_size, f"{FIELD}: block_size",
            f"the graph was calibrated for blocks of {graph.block_size}, SGLang's dLLM block "
            f"size is {block_size} (set block_size: {graph.block_size} in the YAML)")
    require(y.budget is None or y.budget == d, f"{FIELD}: budget",
            f"D={y.budget} but the graph file holds {d} nodes")
    require(y.keep is None or 1 <= y.keep <= d, f"{FIELD}: keep",
            f"must be an integer [1, {d}], got {y.keep}")
    params = rule_params(graph.rule)
    s = y.unmask_per_step
    if s is not None:
        require(params.threshold is None and s == params.unmask_per_step,
                f"{FIELD}: unmask_per_step", f"{s} differs from the graph's rule {graph.rule!r}")
    t = y.threshold
    if t is not None:
        require(params.threshold is not None and float(t) == params.threshold,
                f"{FIELD}: threshold", f"{t!r} differs from the graph's rule {graph.rule!r}")
    banned = [mask_id] if y.banned_token_ids is None else y.banned_token_ids
    return SpiffyConfig(graph, y.graph, d if y.keep is None else y.keep, params, mask_id,
                        y.eos_token_id, tuple(sorted(set(banned) | {mask_id})), y.seed)


def parse_spiffy_config(raw: Any, *, block_size: int, mask_id: int) -> SpiffyConfig:
    """Validate an algorithm config mapping; raise `ConfigError` naming the key and range."""
    return spiffy_config(read_yaml(raw), block_size=block_size, mask_id=mask_id)


# --- per-request sampling ---------------------------------------------------------------------
def unsupported_sampling(top_k: int, min_p: float) -> str | None:
    """Why a request's sampling params cannot be honoured exactly (the reference runtime samples
    with temperature and top-p only), or None. Temperature and top-p ranges are SGLang's own
    check (`SamplingParams.verify`), which rejects a bad request before it is scheduled."""
    if 1 < top_k < TOP_K_ALL:
        return (f"top_k={top_k} is not supported by this dLLM algorithm (it samples with "
                "temperature and top_p only); leave top_k unset")
    if min_p > 0:
        return (f"min_p={min_p} is not supported by this dLLM algorithm (it samples with "
                "temperature and top_p only); leave min_p unset")
    return None


def request_params(rule: DecodeParams, temperature: float, top_p: float,
                   top_k: int) -> DecodeParams:
    """The decoding params of one request: the graph's rule at the request's temperature and
    top-p, as SGLang resolved them; `rule` itself (greedy) where SGLang means greedy (top_k 1,
    which is how it stores temperature 0) or the temperature is 0."""
    if top_k <= 1 or temperature == 0:
        return rule
    return rule.with_(temperature=float(temperature), top_p=float(top_p))


def request_seed(seed: int, rid: Any) -> int:
    """The seed of a sampled request that gives no `sampling_seed`: 63 bits of
    sha256("{seed}:{rid}") (YAML `seed`, SGLang's request id), the same in every process."""
    digest = hashlib.sha256(f"{seed}:{rid}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def decodable_positions(
    ids: torch.Tensor,  # [batch, block] canvas
    prompt_mask: torch.Tensor | None,  # [batch, block] True where the prompt owns the position
    mask_id: int,
    eos_token_id: int | None,
) -> torch.Tensor:  # [batch, block] bool: masked, not prompt, before any generated EOS
    gen = torch.ones_like(ids, dtype=torch.bool) if prompt_mask is None else ~prompt_mask
    ok = (ids == mask_id) & gen
    if eos_token_id is not None:
        eos_seen = ((ids == eos_token_id) & gen).long().cumsum(-1) > 0
        ok &= ~eos_seen
    return ok


def checkpoint_defaults(hf_config: Any, algorithm_config: dict) -> tuple[int | None, int | None]:
    """What a checkpoint of this project declares for SGLang's dLLM runtime: (mask id, block size)
    to use instead of SGLang's per-architecture table (SDAR: mask 151669, block 4), and the EOS /
    banned ids of the reference runtime put into `algorithm_config` where the YAML has none."""
    mask = getattr(hf_config, "mask_token_id", None)
    block = getattr(hf_config, "dllm_block_size", None)
    if mask is None:
        return None, None
    eos = getattr(hf_config, "eos_token_id", None)
    eos = eos[0] if isinstance(eos, list) else eos
    pad = getattr(hf_config, "pad_token_id", None)
    if eos is not None:
        algorithm_config.setdefault("eos_token_id", int(eos))
    banned = {int(mask)} | ({int(pad)} if pad is not None and pad != eos else set())
    algorithm_config.setdefault("banned_token_ids", sorted(banned))
    return int(mask), (None if "block_size" in algorithm_config or block is None else int(block))


def eager_dllm_unsupported(model_runner) -> str | None:
    """Why SGLang cannot run this server's dLLM forwards at all, or None. With no CUDA graph
    runner every DLLM_EXTEND forward runs eagerly, and SGLang's FlashAttention backend (fa3/fa4,
    its default on Hopper) plans no attention metadata for that mode outside a graph (0.5.16 to
    0.5.23: `FlashAttentionBackend.init_forward_metadata` has no DLLM_EXTEND branch), so its
    kernel fails at the first forward ("batch_size must be equal to batch_size_k"), with draft
    rows or without. SGLang moves dLLM to flashinfer itself only when CUDA graphs are on."""
    graphs = getattr(model_runner, "decode_cuda_graph_runner", None)
    if graphs is not None and graphs is not getattr(model_runner, "eager_runner", None):
        return None
    backend = getattr(model_runner, "attn_backend", None)
    backend = getattr(backend, "prefill_backend", backend)  # hybrid: extends use its prefill one
    if not any(c.__name__ == "FlashAttentionBackend" for c in type(backend).__mro__):
        return None
    return ("SGLang's FlashAttention backend (fa3/fa4, its default on Hopper) cannot run dLLM "
            "forwards without CUDA graphs (it plans no attention metadata for them); pass "
            "--attention-backend flashinfer (or triton), or leave CUDA graphs on")


# --- registration (SGLang imported only from here on, inside functions) -----------------------
ALGORITHMS: dict[str, str] = {}  # --dllm-algorithm name -> "module:Class"; filled by register
PARSERS: dict[str, str] = {}  # name -> "module:function" of its SGLang-free config parser
GET_ALGORITHM = "sglang.srt.dllm.algorithm.get_algorithm_cls"
GET_ALGORITHM_LEGACY = "sglang.srt.dllm.algorithm.get_algorithm"  # SGLang < 0.5.21 (by config)
DLLM_CONFIG = "sglang.srt.dllm.config.DllmConfig.from_server_args"


def _resolve_algorithm(original, name, *args, **kwargs):
    """AROUND hook on SGLang's `get_algorithm_cls`: our names first, then SGLang's own."""
    import pkgutil

    if name in ALGORITHMS:
        return pkgutil.resolve_name(ALGORITHMS[name])
    return original(name, *args, **kwargs)


def _build_algorithm(original, config, *args, **kwargs):
    """AROUND hook on `get_algorithm(config)`, SGLang < 0.5.21's only lookup (it has no
    `get_algorithm_cls`): our names are built here, all others by SGLang."""
    import pkgutil

    if getattr(config, "algorithm", None) in ALGORITHMS:
        return pkgutil.resolve_name(ALGORITHMS[config.algorithm])(config)
    return original(config, *args, **kwargs)


def _apply_dllm_defaults(result, server_args, *args, **kwargs):
    """AFTER hook on `DllmConfig.from_server_args`. For our algorithms, the YAML key
    `max_running_requests` sets the requests denoised at once, apart from the server's
    `--max-running-requests`, which also bounds the sequences of one forward (requests x
    (1 + D*) with drafts). SDAR checkpoints that declare their mask token (ours, see `sdar.py`)
    get their mask id and block size; others are left as SGLang made them. On SGLang < 0.5.21
    (no `configure_server_args` at launch) our algorithm config is also validated here, which
    SGLang runs while it resolves the server arguments."""
    result = _dllm_defaults(result, server_args)
    if result is not None and result.algorithm in PARSERS and not _names_resolve():
        import pkgutil

        pkgutil.resolve_name(PARSERS[result.algorithm])(
            result.algorithm_config, block_size=result.block_size, mask_id=result.mask_id)
    return result


def _dllm_defaults(result, server_args):
    if result is None:
        return result
    n = result.algorithm_config.get("max_running_requests")
    if result.algorithm in ALGORITHMS and isinstance(n, int) and n >= 1:  # else parse() fails
        result.max_running_requests = n
    from sglang.srt.configs.model_config import ModelConfig

    try:
        from sglang.srt.arg_groups.overrides import resolving_view
    except ImportError:  # SGLang < 0.5.19 reads the server arguments (or their view) directly
        cfg = server_args
    else:
        cfg = resolving_view(server_args)
    hf = ModelConfig.from_server_args(server_args, model_path=cfg.model_path,
                                      model_revision=cfg.revision).hf_config
    if (getattr(hf, "architectures", None) or [""])[0] not in ("SDARForCausalLM",
                                                                "SDARMoeForCausalLM"):
        return result
    mask, block = checkpoint_defaults(hf, result.algorithm_config)
    if mask is not None:
        result.mask_id = mask
    if block is not None:
        result.block_size = block
    return result


def _names_resolve() -> bool:
    """SGLang >= 0.5.21: algorithms are looked up by name (`get_algorithm_cls`) and validate
    their config at launch (`configure_server_args`)."""
    from .versions import SGLANG_ALGORITHM_CLS, sglang_at_least

    return sglang_at_least(SGLANG_ALGORITHM_CLS)


def register_dllm_algorithm(name: str, class_path: str, parser: str | None = None) -> None:
    """Make `--dllm-algorithm NAME` resolve to `class_path` ("module:Class", imported when
    SGLang asks for it); `parser` ("module:function", SGLang-free) validates its config at launch
    where SGLang does not ask the class. Idempotent. SGLang has no registry for dLLM algorithms
    (it collects the modules of its own package), so this uses its plugin hook registry."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    prev = ALGORITHMS.get(name, class_path)
    require(prev == class_path, "--dllm-algorithm", f"{name!r} is already registered as {prev}")
    if not ALGORITHMS:  # the first algorithm (of any package) installs the lookup hooks, once
        if _names_resolve():
            HookRegistry.register(GET_ALGORITHM, _resolve_algorithm, HookType.AROUND)
        else:
            HookRegistry.register(GET_ALGORITHM_LEGACY, _build_algorithm, HookType.AROUND)
        HookRegistry.register(DLLM_CONFIG, _apply_dllm_defaults, HookType.AFTER)
    ALGORITHMS[name] = class_path
    if parser is not None:
        PARSERS[name] = parser


def register() -> None:
    """The `sglang.srt.plugins` entry point `spiffy_plugin` (loaded by SGLang's launcher,
    scheduler and detokenizer; a failure is logged by SGLang's loader). Idempotent. Independent
    of SpecFold's entry point and of the order SGLang runs them in."""
    register_dllm_algorithm("Spiffy", "spiffy_plugin.engines.sglang_algorithm:Spiffy",
                            "spiffy_plugin.engines.sglang:parse_spiffy_config")
