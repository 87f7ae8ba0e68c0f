"""DFlash: a block-diffusion drafter that proposes a whole block per forward, verified losslessly.

Public entry points: `load_drafter`/`save_drafter` (z-lab checkpoint format), `DFlashProposer`,
`speculative_generate` (reference runtime), `SamplingParams`, `ConfigError`.
"""

from .checkpoint import load_drafter, save_drafter
from .config import DFlashConfig, load_config
from .errors import ConfigError
from .generate import speculative_generate
from .proposers import DFlashProposer
from .sampling import SamplingParams

__all__ = [
    "ConfigError", "DFlashConfig", "DFlashProposer", "SamplingParams", "load_config",
    "load_drafter", "save_drafter", "speculative_generate",
]
