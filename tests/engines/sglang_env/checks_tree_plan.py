"""DFLASH_TREE's sync-free tree-verify plan (`dflash_plugin/engines/sglang_tree_plan.py`) against
SGLang 0.5.16's flashinfer backend source (static conformance; the backend needs flashinfer to
import, absent on CPU, so its source file is read). Run with `checks_tree.py` (same environments);
skips on other SGLang versions.
"""

import inspect

import pytest

from tests.engines.sglang_env import shims

shims.install()

from tests.engines.sglang_env.checks_tree import OLD  # noqa: E402

OLD_ONLY = pytest.mark.skipif(not OLD, reason="the host plan is written against SGLang 0.5.16")


@OLD_ONLY
def test_host_plan_matches_flashinfer_backend_calls_and_fast_prefill_plan():
    """`sglang_tree_plan` relies on 0.5.16's flashinfer backend: TARGET_VERIFY graph wrappers
    in `prefill_cuda_graph_metadata[bs]`, `call_begin_forward` calling `begin_forward` with the
    eight positional arguments `tree_verify_plan` names and the mask as `custom_mask=`, and
    `fast_prefill_plan` taking those plus the host layout as keyword-only arguments. Read from
    the source file (importing the backend needs flashinfer, absent on CPU)."""
    import ast
    import importlib.util
    from pathlib import Path

    from dflash_plugin.engines.sglang_tree_plan import tree_verify_plan

    spec = importlib.util.find_spec("sglang.srt.layers.attention.flashinfer_backend")
    src = Path(spec.origin).read_text()
    fns = {n.name: n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.FunctionDef)}
    fast = fns["fast_prefill_plan"].args
    positional = [a.arg for a in fast.args]
    ours = list(inspect.signature(tree_verify_plan).parameters)
    assert positional[:9] == ["self", *ours[1:9]]  # self <-> our wrapper argument
    assert [a.arg for a in fast.kwonlyargs] == ["qo_indptr_host", "kv_indptr_host",
                                                "kv_lens_host", "max_q_len", "max_kv_len"]
    call = ast.get_source_segment(src, fns["call_begin_forward"])
    tail = call.split("wrapper_paged.begin_forward(")[-1]
    assert "custom_mask=use_custom_mask," in tail and "self.head_dim,\n            1," in tail
    prep = ast.get_source_segment(src, fns["_prepare_cuda_graph_metadata"])
    assert "self.prefill_cuda_graph_metadata[bs] = prefill_wrappers" in prep
    assert "forward_mode.is_target_verify()" in prep
    # the packed-mask buffer of the graph wrappers is the graph's mask buffer itself (the plan
    # packs over it in place: tests/engines/test_sglang_tree_plan.py)
    wrappers = ast.get_source_segment(src, fns["_create_prefill_wrappers"])
    assert '"custom_mask_buf": self.cuda_graph_custom_mask,' in wrappers


@OLD_ONLY
def test_late_seq_lens_matches_the_scheduler():
    """`sglang_tree_seqlens` (DFLASH_TREE_LATE_SEQ_LENS=1) relies on 0.5.16's scheduler asking
    the speculative worker's `spec_v2_attn_backends` whether any needs `seq_lens_cpu`, on
    `resolve_seq_lens_cpu` then leaving `seq_lens_cpu` None, and on the decode batch carrying
    `req_pool_indices_cpu` (the slots the mirror is read by). Read from the source files."""
    import importlib.util
    from pathlib import Path

    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    def src(mod):
        return Path(importlib.util.find_spec(mod).origin).read_text()

    sched = src("sglang.srt.managers.scheduler")
    assert '"spec_v2_attn_backends",' in sched and "decide_needs_cpu_seq_lens(" in sched
    overlap = src("sglang.srt.managers.overlap_utils")
    assert 'getattr(b, "needs_cpu_seq_lens", True) for b in attn_backends' in overlap
    assert "if not self.needs_cpu_seq_lens:" in overlap
    assert "batch.seq_lens_cpu = None" in overlap
    assert isinstance(inspect.getattr_static(DFlashWorkerV2, "spec_v2_attn_backends"), property)
    assert "req_pool_indices_cpu" in ScheduleBatch.__dataclass_fields__
    # fa3 (the recommended drafter backend) opts out; flashinfer (the tree's target) does not
    assert "needs_cpu_seq_lens: bool = False" in src(
        "sglang.srt.layers.attention.flashattention_backend")
    assert "needs_cpu_seq_lens" not in src("sglang.srt.layers.attention.flashinfer_backend")


@OLD_ONLY
def test_worker_leaves_the_target_backend_out_only_with_late_seq_lens():
    """The scheduler's question goes to the drafter's backend alone with late seq lens, to both
    (DFlashWorkerV2's own answer) without. A bare instance: nothing of the worker is built."""
    from types import SimpleNamespace

    from dflash_plugin.engines.sglang_tree_worker import worker_class

    w = worker_class().__new__(worker_class())
    target, draft = SimpleNamespace(name="flashinfer"), SimpleNamespace(name="fa3")
    w._target_worker = SimpleNamespace(model_runner=SimpleNamespace(attn_backend=target))
    w.draft_model_runner = SimpleNamespace(attn_backend=draft)
    w._late_seq_lens = False
    assert w.spec_v2_attn_backends == (target, draft)
    w._late_seq_lens = True
    assert w.spec_v2_attn_backends == (draft,)
