"""fa3's replay metadata of the tree verify as one CUDA graph per batch size
(`DFLASH_TREE_FA3_GRAPH=1`; its first GPU run, 2026-12-05, failed on the mask size that
`_whole_mask_call` now fixes; with the fix it ran on an H100 the same day, `=check` included).

Before each replay of a TARGET_VERIFY graph, SGLang 0.5.16's decode graph runner calls the
backend's `init_forward_metadata_out_graph` eagerly. For fa3 with top-K > 1
(`FlashAttentionBackend._apply_cuda_graph_metadata`, the cascade of section 12 of
`sglang_tree_design.md`) that is about 25 launches from Python per round: the prefix part's page
table, and for the tree part the mask gather, a sort and the per-query page tables. DFLASH's
chain verify (top-K 1) launches about 5. Every input is a static buffer of the runner (its
`req_pool_indices` and `seq_lens` rows, the backend's mask buffer; of `positions` only the size)
and every output a static buffer of the backend. So an AROUND hook (`replay_metadata`) replays
the same work as one CUDA graph per (backend, batch size, tokens), captured on first use. The
work recomputes its outputs from its inputs, so a capture's eager warm-up changes nothing.

Any other call runs SGLang's code: another mode, top-K 1, sliding-window or encoder settings, a
drafter's backend, another algorithm, or input tensors other than the captured ones.
"""

from __future__ import annotations

import logging
import os

import torch

from ..errors import ConfigError
from ..fast.graphs import StepGraphs

logger = logging.getLogger(__name__)

ENV = "DFLASH_TREE_FA3_GRAPH"
TARGET = ("sglang.srt.layers.attention.flashattention_backend.FlashAttentionBackend."
          "_apply_cuda_graph_metadata")
_GRAPHS: dict[int, tuple] = {}  # id(backend) -> (graphs, {key: (inputs_key, metadata)})


def mode(environ=os.environ) -> str:
    """`DFLASH_TREE_FA3_GRAPH`: 0 (default), 1, or check (each replay is followed by SGLang's
    eager call, and the metadata buffers must come out the same); a clear error otherwise."""
    raw = environ.get(ENV, "0").strip().lower() or "0"
    if raw not in ("0", "1", "check"):
        raise ConfigError(ENV, f"must be 0, 1 or check (fa3's tree-verify metadata in one CUDA "
                               f"graph), got {raw!r}")
    return raw


def enabled(environ=os.environ) -> bool:
    return mode(environ) != "0"


def graphable(backend, kw: dict, algorithm: str | None) -> bool:
    """Whether this `_apply_cuda_graph_metadata` call is the tree verify's (fa3, top-K > 1,
    DFLASH_TREE's target, its mask in the backend's own buffer) with nothing that reads host
    values or optional buffers."""
    mode, spec = kw.get("forward_mode"), kw.get("spec_info")
    buf = getattr(backend, "cuda_graph_custom_mask", None)
    return (algorithm == "DFLASH_TREE" and mode is not None and mode.is_target_verify()
            and getattr(backend, "topk", 1) > 1 and not getattr(backend, "is_draft_runner", True)
            and not getattr(backend, "use_sliding_window_kv_pool", True)
            and not getattr(backend, "has_swa", True) and kw.get("encoder_lens") is None
            and kw.get("seq_lens_cpu") is None and spec is not None and buf is not None
            and getattr(spec, "custom_mask", None) is not None
            and spec.custom_mask.data_ptr() == buf.data_ptr())


def inputs_key(kw: dict) -> tuple:
    """What a captured graph reads: its tensors' addresses and the number of tokens."""
    spec = kw["spec_info"]
    return (kw["req_pool_indices"].data_ptr(), kw["seq_lens"].data_ptr(),
            spec.custom_mask.data_ptr(), int(spec.positions.numel()))


_SETTLED: dict[str, object] = {}  # the mode at registration, the server's algorithm once known


def _algorithm() -> str | None:
    """The server's speculative algorithm (asked until the server args exist, then kept)."""
    if "algorithm" in _SETTLED:
        return _SETTLED["algorithm"]
    from sglang.srt.runtime_context import get_server_args

    try:
        name = get_server_args().speculative_algorithm
    except Exception:  # no server args in this process (tests, tools)
        return None
    _SETTLED["algorithm"] = str(name).upper() if name else None
    return _SETTLED["algorithm"]


def replay_metadata(original, backend, **kw):
    """AROUND hook of fa3's `_apply_cuda_graph_metadata` (keyword call, as the runner makes);
    installed only when the flag is on (`register_hook`), which fixes the mode."""
    if not graphable(backend, kw, _algorithm()):
        return original(backend, **kw)
    return run_graphed(original, backend, kw, check=_SETTLED.get("mode") == "check")


def run_graphed(original, backend, kw: dict, graphs_factory=StepGraphs, check: bool = False):
    """`original(backend, **kw)` as one graph per (batch size, tokens), captured on first use
    (`check`: SGLang's eager call after each replay must write the same metadata):
    the tokens (the unpadded batch's, `spec_info.positions.numel()`) bound which rows' mask
    positions it reads. A call with other input tensors than its key's graph read runs
    eagerly. Afterwards the backend's `forward_metadata` and
    `forward_metadata_spec_decode_expand` are what the call sets (Python attributes, which a
    replay does not set)."""
    held = _GRAPHS.get(id(backend))
    if held is None:
        runner = graphs_factory(kw["seq_lens"].device, True, capture_error_mode="thread_local")
        held = _GRAPHS[id(backend)] = (runner, {})
    runner, done = held
    tensors = inputs_key(kw)
    key = (int(kw["bs"]), tensors[-1])
    if not runner.enabled or (key in done and done[key][0] != tensors):
        return original(backend, **kw)
    try:
        runner.run(key, lambda: _whole_mask_call(original, backend, kw))
    except RuntimeError as e:
        logger.warning("DFLASH_TREE: capturing fa3's verify metadata failed (%s); SGLang's "
                       "eager path from now on", e)
        runner.enabled = False
        runner.graphs.clear()
        return original(backend, **kw)
    if key not in done:  # what the warm-up set, for every later replay
        done[key] = tensors, (backend.forward_metadata,
                              backend.forward_metadata_spec_decode_expand)
        logger.info("DFLASH_TREE: fa3 tree-verify metadata in a CUDA graph for batch %d, %d "
                    "tokens", *key)
    backend.forward_metadata, backend.forward_metadata_spec_decode_expand = done[key][1]
    if check:
        check_replay(original, backend, kw)
    return None


def _whole_mask_call(original, backend, kw: dict) -> None:
    """`original(backend, **kw)` with the backend's whole mask buffer as `spec_info.custom_mask`
    (restored after). The round's mask is a prefix of that buffer whose length grows with the
    requests' lengths (`sglang_tree_input.full_mask`); a graph captured over the first round's
    prefix keeps that tensor's size, and its mask gather's bounds check then fails once a later
    round's rows lie past it (a device-side assert, 2026-12-05 on the H200). Same address, same
    rows read: the gather's indices come from `seq_lens` and the number of tokens."""
    spec = kw["spec_info"]
    mine = spec.custom_mask
    spec.custom_mask = backend.cuda_graph_custom_mask
    try:
        original(backend, **kw)
    finally:
        spec.custom_mask = mine


def _tensors(*metadata) -> dict:
    return {(i, k): v for i, md in enumerate(metadata) for k, v in vars(md).items()
            if isinstance(v, torch.Tensor)}


def check_replay(original, backend, kw: dict) -> None:
    """Raise unless SGLang's eager call writes what the replay wrote (host sync: checks)."""
    pair = (backend.forward_metadata, backend.forward_metadata_spec_decode_expand)
    replayed = {k: v.clone() for k, v in _tensors(*pair).items()}
    original(backend, **kw)
    for k, v in _tensors(*pair).items():
        if not torch.equal(v, replayed[k]):
            raise RuntimeError(f"{ENV}=check: the replayed fa3 metadata differs from SGLang's "
                               f"in {k} at batch {kw['bs']}")


def register_hook() -> None:
    """Install the AROUND hook once (HookRegistry applies it in `load_plugins`)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    _SETTLED["mode"] = mode()
    if not any(h is replay_metadata for _, h, _ in HookRegistry._hooks.get(TARGET, [])):
        HookRegistry.register(TARGET, replay_metadata, HookType.AROUND)
