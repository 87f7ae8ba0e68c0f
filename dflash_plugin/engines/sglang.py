"""SGLang adapter for DFlash: checks of a drafter against SGLang's own loader.

SGLang (0.5.23) serves z-lab checkpoints natively (`--speculative-algorithm DFLASH
--speculative-draft-model-path DIR`); its parser reads `dflash_config.{mask_token_id,
target_layer_ids}`, `block_size` and `num_target_layers`, so a drafter trained here runs there
unchanged. What SGLang lacks is registered under a name of its own by the `sglang.srt.plugins`
entry point `dflash_plugin` (`register`): DFLASH_TREE, tree drafting verified through SGLang's
EAGLE tree path (`sglang_tree_algo.py`, `sglang_tree_worker.py`), and DFLASH_ADAPTIVE, DFLASH
with its block length chosen per step (`sglang_adaptive.py`, `sglang_adaptive_worker.py`).
`check_draft_for_sglang` (`sglang_checks.py`) runs SGLang's own parser and target-layer
selection on a drafter plus our pair check. Builtin algorithm names are reserved in SGLang.
"""

from __future__ import annotations

from .sglang_checks import check_draft_for_sglang

__all__ = ["check_draft_for_sglang", "register"]


def register() -> None:
    """The `sglang.srt.plugins` entry point `dflash_plugin` (loaded by SGLang's launcher, engine,
    scheduler and detokenizer; SGLang's loader logs a failure). Idempotent: registers the
    speculative algorithms DFLASH_TREE (with its CUDA-graph capture hook) and DFLASH_ADAPTIVE
    once, and unless `DFLASH_FAST_DECODE_PREP` / `DFLASH_BATCH_ADMISSION` is 0 their
    decode-step preparation and admission hooks (`sglang_decode_prep`, `sglang_admission`)."""
    from . import (
        sglang_adaptive,
        sglang_adaptive_worker,
        sglang_admission,
        sglang_decode_prep,
        sglang_tree_algo,
        sglang_tree_hooks,
        sglang_tree_worker,
    )

    if sglang_tree_algo.register(sglang_tree_worker.worker_factory):
        sglang_tree_hooks.register_hooks()
    sglang_adaptive.register(sglang_adaptive_worker.worker_factory)
    sglang_decode_prep.register_hook()  # DFLASH_FAST_DECODE_PREP (auto: DFLASH_ADAPTIVE's)
    sglang_admission.register_hook()  # DFLASH_BATCH_ADMISSION (both algorithms)
