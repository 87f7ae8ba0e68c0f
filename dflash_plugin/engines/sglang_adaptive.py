"""`--speculative-algorithm DFLASH_ADAPTIVE` for SGLang: DFLASH with a block length chosen per step.

SGLang gives a DFLASH server one verify width for its life, and its adaptive mode
(`--speculative-adaptive`) is EAGLE-only. DFLASH_ADAPTIVE is DFLASH (same drafter, same causal
verify, same KV injection) whose worker (`sglang_adaptive_worker.py`) picks, before every decode
step, the block length q (q - 1 drafted tokens; q = 1: plain decoding, no drafter forward) of
the most expected tokens per second (`adaptive.ServerPolicy`): step times per batch size
measured by `dflash tune --engine sglang` (its JSON, passed as SGLang's own
`--speculative-adaptive-config`), acceptance observed live. Flags:
`--speculative-draft-model-path DIR` (z-lab drafter), `--speculative-adaptive-config TUNE.json`,
optional `--speculative-num-draft-tokens W` (the longest block, default the drafter's block).
SGLang is imported lazily.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

from ..adaptive import AdaptiveConfig
from ..errors import ConfigError, require
from ..tune import Cell, by_concurrency, round_ms
from .sglang_adaptive_defer import capacity_from_env
from .sglang_admission import size_from_env as admission_size
from .sglang_decode_prep import mode as decode_prep_mode
from .sglang_plain_attention import enabled as plain_attention_enabled
from .sglang_prefill import enabled as async_prefill_enabled
from .sglang_prefill_append import mode as prefill_append_mode

NAME = "DFLASH_ADAPTIVE"
FLAG = "speculative_adaptive_config"
# the server's policy: probes (two steps each, `adaptive.StepClock`) at most 1 % of the plain
# steps' time: a plain step inside DFLASH's worker already costs 2-4 % over SGLang's own at the
# Qwen3-8B shape (H200, 2026-12-03), so probes at 3 % put the goal (0.97x) out of reach; and
# each probe that leaves the choice where it was doubles the next one's spacing, up to 4x
# (0.25 %): on the H200 the 1 % probes were about half of what kept the server at 0.95x plain
# (2026-12-04), the plain step inside the worker the rest
SERVER_CONFIG = AdaptiveConfig(probe_overhead=0.01, probe_backoff=2)
PROBE_STEPS = 2


def step_times(doc: dict, max_q: int | None = None) -> dict[int, dict[int, float]]:
    """concurrency -> {q: ms of one step} from a `dflash tune` report (`round_ms` of its cells;
    q = k + 1, q = 1 plain), q <= max_q; what SGLang's DFLASH_ADAPTIVE decides by."""
    require(isinstance(doc, dict) and doc.get("kind") == "dflash-tune",
            FLAG,
            "must be the JSON `dflash tune` writes (kind dflash-tune)")
    require(doc.get("engine") == "sglang", FLAG,
            f"step times must be measured in SGLang (`dflash tune --engine sglang`), got "
            f"engine {doc.get('engine')!r}")
    try:
        cells = [Cell(**{k: c[k] for k in ("k", "concurrency", "tokens_per_s", "tau")})
                 for c in doc.get("cells", [])]
    except (KeyError, TypeError) as e:
        raise ConfigError(FLAG, f"a cell lacks a field: {e}") from e
    try:
        rows = {c: {q: ms for q, ms in round_ms(row).items() if max_q is None or q <= max_q}
                for c, row in by_concurrency(cells).items()}
    except (TypeError, ConfigError) as e:
        raise ConfigError(FLAG, f"bad cell: {e}") from e
    rows = {c: r for c, r in rows.items() if r}
    require(bool(rows), FLAG,
            f"no measured step time with a block length <= {max_q}")
    return rows


def load_step_times(path: str | None, max_q: int) -> dict[int, dict[int, float]]:
    """concurrency -> {q: ms} from the tune JSON at `path`, q <= max_q, or a `ConfigError`
    naming the flag."""
    require(path is not None, FLAG,
            f"required for {NAME}: the JSON of `dflash tune --engine sglang` (its step times)")
    p = Path(path)
    require(p.is_file(), FLAG, f"no such file: {path!r}")
    try:
        doc = json.loads(p.read_text())
    except ValueError as e:
        raise ConfigError(FLAG, f"{path!r} is not JSON: {e}") from e
    return step_times(doc, max_q)


def _drafter_block(draft: str | None) -> int:
    require(draft is not None, "speculative_draft_model_path", f"required for {NAME}")
    cfg = Path(draft) / "config.json"
    require(cfg.is_file(), "speculative_draft_model_path",
            f"{NAME} needs a local drafter folder with config.json (z-lab format), got {draft!r}")
    block = json.loads(cfg.read_text()).get("block_size")
    require(isinstance(block, int) and block >= 2, "speculative_draft_model_path",
            f"the drafter's config.json needs block_size >= 2, got {block!r}")
    return block


def max_block(server_args) -> int:
    """W: --speculative-num-draft-tokens, default the drafter's block; in [2, block]."""
    block = _drafter_block(getattr(server_args, "speculative_draft_model_path", None))
    w = getattr(server_args, "speculative_num_draft_tokens", None) or block
    require(isinstance(w, int) and 2 <= w <= block, "speculative_num_draft_tokens",
            f"must be in [2, {block}] (the drafter's block size), got {w}")
    return w


def validate_server_args(server_args) -> None:
    """SGLang's launch-time validator: every check before any work, the device last."""
    sa = server_args
    w = max_block(sa)
    load_step_times(getattr(sa, FLAG, None), w)
    capacity_from_env()  # the worker's environment flags: a bad value fails at launch
    plain_attention_enabled()
    async_prefill_enabled()
    decode_prep_mode()
    prefill_append_mode()
    admission_size()
    topk = getattr(sa, "speculative_eagle_topk", None)
    require(topk in (None, 1), "speculative_eagle_topk", f"{NAME} drafts one path: 1, got {topk}")
    for flag, ok, allowed in [
        ("tp_size", (sa.tp_size or 1) == 1, "1 (the runtime states are built on one GPU)"),
        ("pp_size", (sa.pp_size or 1) == 1, "1"),
        ("enable_dp_attention", not sa.enable_dp_attention, "off"),
        ("speculative_draft_window_size", getattr(sa, "speculative_draft_window_size", None)
         is None, "unset (the compact drafter cache is not switched per step)"),
        ("speculative_adaptive", not getattr(sa, "speculative_adaptive", False),
         f"off (SGLang's flag is EAGLE-only; {NAME} is adaptive by itself)"),
    ]:
        require(ok, flag, f"{NAME} needs {allowed}, got {getattr(sa, flag, None)!r}")
    from .sglang_checks import sglang_version
    from .sglang_tree_algo import WORKER_VERSIONS

    have, (lo, hi) = sglang_version(), WORKER_VERSIONS
    require(have is None or lo <= have <= hi, "sglang",
            f"{NAME}'s worker is written against SGLang 0.5.16; installed "
            f"{'.'.join(map(str, have or ()))} is not supported yet")
    device = sa.device or "cuda"
    require(device.startswith("cuda"), "device",
            f"{NAME} needs a CUDA device (DFLASH is CUDA-only in SGLang), got {device!r}")


def handle_server_args(server_args) -> None:
    """DFLASH's own defaulting (SGLang runs it only for its builtin name), W resolved first."""
    from sglang.srt.arg_groups.speculative_hook import _handle_dflash

    server_args.speculative_num_draft_tokens = max_block(server_args)
    _handle_dflash(server_args)


@cache
def spec_class() -> type:
    """`DFlashAdaptiveAlgo`: DFLASH's family answers (DFLASH_TREE's class); each runtime state
    sizes its verify graphs for its own q."""
    from .sglang_tree_algo import spec_class as tree_class

    class DFlashAdaptiveAlgo(tree_class()):
        def handle_server_args(self, server_args) -> None:
            handle_server_args(server_args)

        def get_num_tokens_per_req_for_target_verify(self, num_draft_tokens: int,
                                                     is_draft_worker: bool) -> int:
            return num_draft_tokens  # target and drafter alike: the state's q

    return DFlashAdaptiveAlgo


def register(worker_factory=None) -> bool:
    """Register DFLASH_ADAPTIVE (idempotent: True when this call registered it)."""
    from .sglang_tree_algo import register_algorithm

    return register_algorithm(NAME, spec_class(), validate_server_args, worker_factory)
