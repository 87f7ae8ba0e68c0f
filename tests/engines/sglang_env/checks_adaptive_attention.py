"""DFLASH_ADAPTIVE's plain-step attention (`DFLASH_ADAPTIVE_PLAIN_ATTENTION`,
`engines/sglang_plain_attention.py`) against SGLang 0.5.16's FA3 backend source, statically (the
module imports CUDA kernels): every member the subclass calls or reads exists with the
parameters it passes, the decode path takes precomputed scheduler metadata, and a verify reaches
the backend through `forward_extend`. Run with `checks_adaptive.py` (the 0.5.16 env through
`test_sglang_tree.py`; skipped in the 0.5.23 env, whose `test_sglang.py` globs `checks*.py`)."""

import ast
import importlib.util
from pathlib import Path

import pytest

from tests.engines.sglang_env import shims

shims.install()

from spiffy_plugin.engines.versions import installed  # noqa: E402

OLD_ONLY = pytest.mark.skipif(installed("sglang") > (0, 5, 16),
                              reason="the worker is written against SGLang 0.5.16")


def _source(module: str) -> str:
    return Path(importlib.util.find_spec(module).origin).read_text()


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def _methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}


def _params(fn: ast.FunctionDef) -> list[str]:
    return [a.arg for a in fn.args.args]


@OLD_ONLY
def test_fa3_backend_has_what_the_plain_step_subclass_uses():
    from dflash_plugin.engines import sglang_plain_attention as pa

    src = _source("sglang.srt.layers.attention.flashattention_backend")
    tree = ast.parse(src)
    fa3 = _methods(_class(tree, pa.FA3_CLASS))
    assert set(pa.NEEDS) <= set(fa3)
    # the decode path takes every argument the extend path does, in the same order
    assert _params(fa3["forward_decode"]) == _params(fa3["forward_extend"])
    assert _params(fa3["_compute_scheduler_metadata"]) == [
        "self", "batch_size", "max_seq_len_k", "cache_seqlens", "cu_seqlens_q"]
    assert _params(fa3["init_forward_metadata_out_graph"]) == ["self", "forward_batch",
                                                               "in_capture"]
    assert _params(fa3["init_forward_metadata"]) == ["self", "forward_batch"]
    decode = ast.get_source_segment(src, fa3["forward_decode"])
    assert "metadata = self.forward_metadata" in decode
    assert "sched_meta = metadata.scheduler_metadata" in decode
    assert "scheduler_metadata=sched_meta" in decode
    graph_state = ast.get_source_segment(src, fa3["init_cuda_graph_state"])
    assert "self._sched_meta_buf = torch.zeros(" in graph_state
    for name in ("init_forward_metadata", "_apply_cuda_graph_metadata"):
        assert "self.forward_metadata = metadata" in ast.get_source_segment(src, fa3[name])
    assert "self.max_context_len" in src and "self.fa_impl_ver" in src
    fields = {n.target.id for n in _class(tree, "FlashAttentionMetadata").body
              if isinstance(n, ast.AnnAssign)}
    assert {"max_seq_len_q", "cache_seqlens_int32", "cu_seqlens_q",
            "scheduler_metadata"} <= fields


@OLD_ONLY
def test_a_verify_reaches_the_backend_through_forward_extend():
    """The base backend's `forward` sends decode batches to `forward_decode` and the rest (a
    verify among them) to `forward_extend`, which the subclass overrides."""
    src = _source("sglang.srt.layers.attention.base_attn_backend")
    base = _methods(_class(ast.parse(src), "AttentionBackend"))
    body = ast.get_source_segment(src, base["forward"])
    assert "forward_batch.forward_mode.is_decode()" in body
    assert body.index("self.forward_decode(") < body.index("self.forward_extend(")
