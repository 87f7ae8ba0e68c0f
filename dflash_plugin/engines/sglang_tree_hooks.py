"""DFLASH_TREE's HookRegistry hooks (SGLang's plugin hooks; nothing is patched by hand).

`capture_spec_info` wraps `DecodeCudaGraphRunner.get_spec_info` so that the target's verify
graphs are captured with a tree input carrying the runner's custom-mask buffer (DFLASH's
capture input has none); `DFLASH_TREE_FA3_GRAPH=1` adds `sglang_tree_fa3meta`'s.
"""

from __future__ import annotations

from .sglang_tree_algo import NAME

GET_SPEC_INFO = ("sglang.srt.model_executor.runner.decode_cuda_graph_runner."
                 "DecodeCudaGraphRunner.get_spec_info")


def _is_ours(algo) -> bool:
    return getattr(algo, "name", None) == NAME


def capture_spec_info(original, runner, num_tokens):
    """AROUND hook of `DecodeCudaGraphRunner.get_spec_info`: for DFLASH_TREE's *target* runner,
    capture the verify graphs with a tree input that carries the runner's custom-mask buffer
    (as EAGLE's / NGRAM's capture does); everything else is SGLang's."""
    mr = runner.model_runner
    if not _is_ours(mr.spec_algorithm) or mr.is_draft_worker:
        return original(runner, num_tokens)
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

    cls = _verify_cls()
    return cls(draft_token=None, custom_mask=runner.buffers.custom_mask, positions=None,
               retrieve_index=None, retrieve_next_token=None, retrieve_next_sibling=None,
               retrieve_cum_len=None, spec_steps=1,
               topk=max(2, int(mr.server_args.speculative_eagle_topk or 2)),
               draft_token_num=runner.captured_req_width,
               capture_hidden_mode=CaptureHiddenMode.FULL, seq_lens_sum=None,
               seq_lens_cpu=None)


def _verify_cls():
    from .sglang_tree_input import verify_input_class

    return verify_input_class()


def register_hooks() -> None:
    """Install the capture hook once (HookRegistry applies it in `load_plugins`), and fa3's
    graphed verify metadata when `DFLASH_TREE_FA3_GRAPH=1` (`sglang_tree_fa3meta`)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from . import sglang_tree_fa3meta

    if not any(h is capture_spec_info for _, h, _ in HookRegistry._hooks.get(GET_SPEC_INFO, [])):
        HookRegistry.register(GET_SPEC_INFO, capture_spec_info, HookType.AROUND)
    if sglang_tree_fa3meta.enabled():
        sglang_tree_fa3meta.register_hook()
