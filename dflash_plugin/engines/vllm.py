"""vLLM adapter: the `vllm.general_plugins` entry point `dflash_plugin` of this package.

vLLM (0.32) serves z-lab DFlash checkpoints natively: architecture `DFlashDraftModel`, method
"dflash", target layer ids read from `dflash_config` (+1 to its aux hidden-state indices, the
same convention as ours), mask token from `dflash_config.mask_token_id`. What it lacks is a check
that the drafter belongs to the target: a drafter built for another target starts and silently
accepts less. `register` re-registers `DFlashDraftModel` with a subclass of vLLM's own class that
validates the pair at start-up and otherwise runs vLLM's code unchanged.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

ARCHITECTURE = "DFlashDraftModel"
VALIDATED_CLASS = "dflash_plugin.engines.vllm_model:ValidatedDFlashQwen3ForCausalLM"


def register() -> None:
    """Entry point (loaded in every vLLM process). Idempotent; registration only. vLLM calls
    general plugins unguarded, so a failure is logged here and vLLM keeps its own class."""
    try:
        from vllm import ModelRegistry

        ModelRegistry.register_model(ARCHITECTURE, VALIDATED_CLASS)
    except Exception:
        logger.exception("dflash_plugin: %s not registered; vLLM serves it with its own class "
                         "(no drafter/target pair check)", ARCHITECTURE)
