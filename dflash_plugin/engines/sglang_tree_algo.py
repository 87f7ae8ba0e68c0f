"""`--speculative-algorithm DFLASH_TREE` for SGLang: the registered algorithm and its server args.

SGLang has no hook to add CLI flags, so the tree maps onto existing ones: the *node budget* N is
`--speculative-num-draft-tokens W` minus one (W = N + 1 = root + nodes, SGLang's verify width),
*top-K* per depth is `--speculative-eagle-topk`, the drafter block B is
`--speculative-dflash-block-size` or the drafter's `block_size`; the tree's depth is
D = min(B - 1, N). The algorithm answers SGLang's `is_*` predicates like DFLASH's family (target
aux-hidden capture, drafter KV sizing, DFlash decode reservation, draft graphs) but not as DFLASH
itself or EAGLE (see `sglang_tree_design.md` beside this file, 1.3). SGLang is imported lazily.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from ..errors import ConfigError, require
from ..tree import capacity
from .sglang_admission import size_from_env as admission_size
from .sglang_decode_prep import mode as decode_prep_mode
from .sglang_prefill import enabled as async_prefill_enabled

logger = logging.getLogger(__name__)

NAME = "DFLASH_TREE"
MAX_WIDTH = 512  # verify width W = N + 1
MAX_TOPK = 64
DEFAULT_TOPK = 8
# The worker is written against SGLang 0.5.16's DFlash worker (ran on the H200); 0.5.23's
# differs too much (see the design note, 2.1): refused at launch with this message.
WORKER_VERSIONS = ((0, 5, 16), (0, 5, 16))
UNSUPPORTED_TARGET_BACKENDS = ("trtllm_mha", "fa4", "flashmla", "cutlass_mla")
# fa3 verifies a tree only through its top-K > 1 cascade (prefix without a mask, then each tree
# token over the tree tokens the FULL mask lets it see, merged); with top-K 1 it ignores the
# mask (0.5.16 `flashattention_backend.py`, `self.topk > 1`) and verifies causally: the same
# mask for a top-1 tree (a chain), but not a path our worker has run, so refused for now
TOPK_GT1_TARGET_BACKENDS = ("fa3",)


@dataclass(frozen=True)
class TreeArgs:
    """The server args the tree reads, engine-free."""

    num_draft_tokens: int | None  # W
    topk: int | None  # K (None: min(DEFAULT_TOPK, N))
    block_size: int | None  # drafter block B
    device: str = "cuda"


@dataclass(frozen=True)
class TreePlan:
    budget: int  # N nodes
    topk: int  # K
    depth: int  # D = min(B - 1, N)
    width: int  # W = N + 1
    block_size: int  # drafter block run per round: L = min(B, W)


def check_tree_args(a: TreeArgs) -> TreePlan:
    """The tree's sizes from the flags, or a `ConfigError` naming the flag and the range."""
    w = a.num_draft_tokens
    require(w is not None, "speculative_num_draft_tokens",
            f"required for {NAME}: the verify width W = node budget + 1, in [2, {MAX_WIDTH}]")
    require(isinstance(w, int) and 2 <= w <= MAX_WIDTH, "speculative_num_draft_tokens",
            f"must be in [2, {MAX_WIDTH}] (node budget + 1), got {w}")
    n = w - 1
    b = a.block_size
    require(isinstance(b, int) and b >= 2, "speculative_dflash_block_size",
            f"must be >= 2 (the drafter block), got {b}")
    k = min(DEFAULT_TOPK, n) if a.topk is None else a.topk
    hi = min(n, MAX_TOPK)
    require(isinstance(k, int) and 1 <= k <= hi, "speculative_eagle_topk",
            f"must be in [1, {hi}] (top-K per depth, at most the node budget), got {k}")
    depth = min(b - 1, n)
    cap = capacity(depth, k)
    require(n <= cap, "speculative_num_draft_tokens",
            f"node budget {n} exceeds the full top-{k} tree of {depth} levels ({cap} nodes): "
            f"raise --speculative-eagle-topk or lower the budget")
    require(a.device.startswith("cuda"), "device",
            f"{NAME} needs a CUDA device (its drafter attention and verify kernels are GPU-only "
            f"in SGLang), got {a.device!r}")
    return TreePlan(n, k, depth, w, min(b, w))


def _drafter_block_size(draft_dir: str) -> int | None:
    cfg = Path(draft_dir) / "config.json"
    require(cfg.is_file(), "speculative_draft_model_path",
            f"{NAME} needs a local drafter folder with config.json (z-lab format), got "
            f"{draft_dir!r}")
    return json.loads(cfg.read_text()).get("block_size")


def validate_server_args(server_args) -> None:
    """SGLang's launch-time validator (`validate_server_args=`): every check before any work,
    the device last (so the other rules are testable on CPU)."""
    sa = server_args
    draft = getattr(sa, "speculative_draft_model_path", None)
    require(draft is not None, "speculative_draft_model_path",
            f"required for {NAME} (a DFlash drafter, z-lab format)")
    block = getattr(sa, "speculative_dflash_block_size", None) or _drafter_block_size(draft)
    plan = check_tree_args(TreeArgs(getattr(sa, "speculative_num_draft_tokens", None),
                                    getattr(sa, "speculative_eagle_topk", None), block,
                                    device="cuda"))
    async_prefill_enabled()  # DFLASH_ASYNC_PREFILL: a bad value fails at launch
    decode_prep_mode()  # DFLASH_FAST_DECODE_PREP too
    admission_size()  # and DFLASH_BATCH_ADMISSION
    from sglang.srt.utils.hf_transformers_utils import get_config

    from .sglang_checks import check_draft_for_sglang

    target = get_config(sa.model_path, trust_remote_code=sa.trust_remote_code)
    check_draft_for_sglang(draft, target, num_draft_tokens=plan.block_size)
    for flag, ok, allowed in [
        ("pp_size", sa.pp_size == 1, "1"),
        ("enable_dp_attention", not getattr(sa, "enable_dp_attention", False), "off"),
        ("speculative_draft_window_size", getattr(sa, "speculative_draft_window_size", None)
         is None, "unset (no compact drafter cache for trees yet)"),
        ("speculative_accept_threshold_single",
         getattr(sa, "speculative_accept_threshold_single", 1.0) == 1.0, "1.0 (lossless)"),
        ("speculative_accept_threshold_acc",
         getattr(sa, "speculative_accept_threshold_acc", 1.0) == 1.0, "1.0 (lossless)"),
        # 0.5.16's eagle_sample then reads verify_input.draft_probs, which a DFlash tree has
        # not (it raises "Rejection sampling requires a target-vocab draft proposal ...")
        ("speculative_use_rejection_sampling",
         not getattr(sa, "speculative_use_rejection_sampling", False),
         "it off (target-only tree sampling)"),
        ("page_size", (sa.page_size or 1) == 1, "1 (tree KV compaction moves single slots)"),
        ("attention_backend", sa.attention_backend not in UNSUPPORTED_TARGET_BACKENDS,
         "flashinfer, triton or fa3 (tree masks)"),
        ("attention_backend", sa.attention_backend not in TOPK_GT1_TARGET_BACKENDS
         or plan.topk > 1, "--speculative-eagle-topk > 1 with fa3 (its tree verify)"),
    ]:
        require(ok, flag, f"{NAME} needs {allowed}, got {getattr(sa, flag, None)!r}")
    from .sglang_checks import sglang_version

    have = sglang_version()
    lo, hi = WORKER_VERSIONS
    require(have is None or lo <= have <= hi, "sglang",
            f"{NAME}'s worker is written against SGLang "
            f"{'.'.join(map(str, lo))}-{'.'.join(map(str, hi))}; installed "
            f"{'.'.join(map(str, have or ()))} is not supported yet")
    check_tree_args(TreeArgs(plan.width, plan.topk, block, device=sa.device or "cuda"))


def check_target_backend(attn_backend) -> None:
    """At worker start, on the target's built attention backend (and the parts of a hybrid
    one): an fa3 backend must hold top-K > 1, or it would verify the tree as a causal chain.
    Catches what the launch check cannot see (a default chosen after it)."""
    parts = [attn_backend, getattr(attn_backend, "decode_backend", None),
             getattr(attn_backend, "prefill_backend", None)]
    for be in (p for p in parts if p is not None):
        if type(be).__name__ == "FlashAttentionBackend":
            require(int(getattr(be, "topk", 0) or 0) > 1, "attention_backend",
                    f"{NAME}'s target runs fa3 with top-K {getattr(be, 'topk', None)}; its tree"
                    " verify needs --speculative-eagle-topk > 1 (or --attention-backend "
                    "flashinfer)")


def handle_server_args(server_args) -> None:
    """Our defaulting (SGLang does not run DFLASH's `_handle_dflash` for a registered
    algorithm): one draft step, the resolved top-K and drafter block, DFLASH's request cap and
    no mixed chunk."""
    sa = server_args
    block = getattr(sa, "speculative_dflash_block_size", None) or _drafter_block_size(
        sa.speculative_draft_model_path)
    plan = check_tree_args(TreeArgs(sa.speculative_num_draft_tokens, sa.speculative_eagle_topk,
                                    block, device="cuda"))
    sa.speculative_num_steps = 1
    sa.speculative_eagle_topk = plan.topk
    sa.speculative_dflash_block_size = plan.block_size  # the drafter block run: min(B, W)
    if sa.max_running_requests is None:
        sa.max_running_requests = 48
    if sa.enable_mixed_chunk:
        sa.enable_mixed_chunk = False
        logger.warning("%s: mixed chunked prefill disabled (as for DFLASH)", NAME)
    logger.info("%s: node budget %d, top-%d, depth %d, verify width %d, drafter block %d",
                NAME, plan.budget, plan.topk, plan.depth, plan.width, plan.block_size)


def _runtime_draft_block() -> int | None:
    """The drafter block of this process's server args (0.5.23: `get_spec()`; 0.5.16:
    `get_server_args()`), or None outside a running server."""
    try:
        from sglang.srt import runtime_context as rc

        cfg = rc.get_spec() if hasattr(rc, "get_spec") else rc.get_server_args()
        return getattr(cfg, "speculative_dflash_block_size", None)
    except Exception:
        return None


@cache
def spec_class() -> type:
    """`DFlashTreeAlgo`, a `CustomSpecAlgo` (defined on first use: SGLang is imported here)."""
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo

    class DFlashTreeAlgo(CustomSpecAlgo):
        """DFLASH's family (drafter, KV injection) with EAGLE's tree verification."""

        def is_dflash_family(self) -> bool:
            return True

        def supports_target_verify_for_draft(self) -> bool:
            return True  # the drafter runner captures TARGET_VERIFY graphs (as DFLASH's)

        def has_draft_kv(self) -> bool:
            return False  # one contiguous drafter block: no EAGLE per-top-k page rounding

        def supports_prefill_shared_read_done(self) -> bool:  # 0.5.23 asks; safe default
            return False

        def handle_server_args(self, server_args) -> None:
            handle_server_args(server_args)

        # SpeculativeAlgorithm methods 0.5.16's CustomSpecAlgo lacks (the scheduler calls them)
        def carries_draft_hidden_states(self) -> bool:
            return False  # no EAGLE hidden states in a disaggregated prefill -> decode handoff

        def need_topk(self) -> bool:
            return False  # the overlap FutureMap relays no EAGLE top-k (the tree is per round)

        def create_future_map(self, device, req_to_token_pool, *args, **kwargs):
            from sglang.srt.managers.overlap_utils import FutureMap

            return FutureMap(device, self, req_to_token_pool, *args, **kwargs)

        def get_num_tokens_per_req_for_target_verify(self, num_draft_tokens: int,
                                                     is_draft_worker: bool) -> int:
            if not is_draft_worker:
                return num_draft_tokens  # the target verifies W tree tokens
            block = _runtime_draft_block()
            return num_draft_tokens if block is None else min(num_draft_tokens, int(block))

    return DFlashTreeAlgo


def register_algorithm(name: str, cls: type, validate, worker_factory) -> bool:
    """Register `name` with SGLang's speculative registry (spec class `cls`, launch validator
    `validate`, `worker_factory(server_args)` giving the worker class); idempotent: True when
    this call registered it. Raises if the name is taken by another class."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import get_spec

    have = get_spec(name)
    if have is not None:
        if type(have).__name__ != cls.__name__ or type(have).__module__ != cls.__module__:
            raise ConfigError("speculative_algorithm",
                              f"{name} is already registered by {type(have).__module__}")
        return False
    require(worker_factory is not None, "worker_factory", f"needed to register {name}")
    SpeculativeAlgorithm.register(name, supports_overlap=True, validate_server_args=validate,
                                  spec_class=cls)(worker_factory)
    return True


def register(worker_factory=None) -> bool:
    """Register DFLASH_TREE (`register_algorithm`; the worker factory is
    `sglang_tree_worker.worker_factory`)."""
    return register_algorithm(NAME, spec_class(), validate_server_args, worker_factory)
