"""DFLASH_TREE with fa3 as the target's backend (`--attention-backend fa3`, top-K > 1): SGLang
0.5.16's own `FlashAttentionBackend.init_forward_metadata` (its eager TARGET_VERIFY path, top-K >
1: the cascade) run on CPU over our tree-verify tensors, request slots and FULL mask. Every
verify query must see exactly the KV slots our tree allows: the whole committed prefix (first
part) plus the slots of its ancestors and itself (second part), the two parts disjoint, so fa3's
LSE merge is attention under our ancestor mask. Only the metadata runs here (no fa3 kernel on
CPU); the backend is a bare instance with the attributes that path reads. Run with
`checks_tree.py` (same environments); skips on other SGLang versions.
"""

from types import SimpleNamespace

import pytest
import torch

from tests.engines.sglang_env import shims

shims.install()

from tests.engines.sglang_env.checks_tree import OLD  # noqa: E402

OLD_ONLY = pytest.mark.skipif(not OLD, reason="fa3 tree verify is checked against SGLang 0.5.16")


def _random_trees(bs, depth, k, n, seed):
    from dflash_plugin.fast.tree_build import build_tree

    gen = torch.Generator().manual_seed(seed)
    lp = torch.randn(bs, depth, 97, generator=gen).log_softmax(-1)
    top_lp, top_ids = lp.topk(k, dim=-1)
    return build_tree(top_lp, top_ids, n)


@pytest.fixture
def fa3_module(monkeypatch):
    """SGLang's flashattention_backend module. It imports `sgl_kernel` (the GPU kernels, not
    installed on CPU) for `merge_state_v2`, which only the attention call uses: a stand-in
    module that raises if called is put in its place for this test only, and the backend module
    (bound to it) is dropped afterwards."""
    import importlib
    import sys
    import types

    name = "sglang.srt.layers.attention.flashattention_backend"
    had = name in sys.modules
    try:
        import sgl_kernel  # noqa: F401
    except ImportError:
        stub = types.ModuleType("sgl_kernel")

        def merge_state_v2(*args, **kwargs):
            raise NotImplementedError("stand-in for sgl_kernel (GPU only)")

        stub.merge_state_v2 = merge_state_v2
        monkeypatch.setitem(sys.modules, "sgl_kernel", stub)
    yield importlib.import_module(name)
    if not had:
        sys.modules.pop(name, None)


def _fa3_backend(module, topk, width, req_to_token):
    FlashAttentionBackend = module.FlashAttentionBackend

    be = FlashAttentionBackend.__new__(FlashAttentionBackend)
    be.__dict__.update(topk=topk, speculative_num_draft_tokens=width, page_size=1,
                       req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
                       req_to_token=req_to_token, max_context_len=req_to_token.shape[1],
                       has_swa=False, use_sliding_window_kv_pool=False,
                       has_local_attention=False, is_prefill_aware_swa=False, attn_cp_size=1,
                       device=req_to_token.device)
    return be


@OLD_ONLY
@pytest.mark.parametrize("bs,depth,k,n", [(1, 6, 2, 9), (3, 15, 4, 31), (4, 8, 8, 40)])
def test_fa3_cascade_sees_exactly_our_tree(fa3_module, bs, depth, k, n):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from dflash_plugin.engines.sglang_tree_input import build_verify_tensors

    gen = torch.Generator().manual_seed(bs * 1000 + n)
    tokens, parents, depths = _random_trees(bs, depth, k, n, seed=n)
    w = n + 1
    seq_lens = torch.randint(1, 50, (bs,), generator=gen)
    t = build_verify_tensors(tokens, parents, depths, torch.zeros(bs, dtype=torch.long),
                             seq_lens, int(seq_lens.sum()), depth)
    slots, ctx = 16, 128  # distinct KV locations per (request slot, position)
    req_to_token = torch.randperm(slots * ctx, generator=gen).view(slots, ctx).to(torch.int32)
    pool = torch.randperm(slots, generator=gen)[:bs]
    be = _fa3_backend(fa3_module, k, w, req_to_token)
    fb = SimpleNamespace(seq_lens=seq_lens, seq_lens_cpu=None, batch_size=bs,
                         forward_mode=ForwardMode.TARGET_VERIFY, req_pool_indices=pool,
                         spec_info=SimpleNamespace(custom_mask=t.custom_mask,
                                                   positions=t.positions),
                         encoder_lens=None, out_cache_loc=None)
    be.init_forward_metadata(fb)
    first, second = be.forward_metadata, be.forward_metadata_spec_decode_expand
    assert first.cu_seqlens_q.tolist() == list(range(0, bs * w + 1, w))
    assert second.cu_seqlens_q.tolist() == list(range(bs * w + 1))
    for b in range(bs):
        row, m = req_to_token[pool[b]].tolist(), int(seq_lens[b])
        prefix = set(row[:m])
        seen = set(first.page_table[b, :int(first.cache_seqlens_int32[b])].tolist())
        assert seen == prefix  # the W queries of the request: its prefix, no mask
        for i in range(w):
            q = b * w + i
            tree = set(second.page_table[q, :int(second.cache_seqlens_int32[q])].tolist())
            want = {row[m + j] for j in range(w) if bool(t.anc[b, i, j])}
            assert tree == want and not tree & prefix, (b, i)


@OLD_ONLY
def test_fa3_takes_the_cascade_only_with_topk_above_one():
    """The top-K gate our launch check and `check_target_backend` rely on: the source branches
    on `self.topk > 1` for TARGET_VERIFY (eager and graph paths)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("sglang.srt.layers.attention.flashattention_backend")
    src = Path(spec.origin).read_text()
    assert "forward_batch.forward_mode.is_target_verify()\n            and self.topk > 1" in src
    assert "if forward_mode.is_target_verify() and self.topk > 1:" in src
    assert "needs_cpu_seq_lens: bool = False" in src


@OLD_ONLY
def test_target_backend_is_built_before_the_drafter_captures():
    """`check_target_backend` runs in the worker's `init_cuda_graphs`: SGLang 0.5.16 builds the
    workers first, then every attention backend, then the graphs (target before drafter), so
    the target's backend exists there and not yet in the worker's `__init__`."""
    import importlib.util
    import re
    from pathlib import Path

    src = Path(importlib.util.find_spec("sglang.srt.managers.scheduler").origin).read_text()
    body = src[src.index("    def init_model_worker(self):"):]
    body = body[:body.index("\n    def ", 10)]
    steps = re.findall(r"self\.(\w+)\(\)", body)
    assert steps.index("maybe_init_draft_worker") < steps.index(
        "init_all_attention_backends") < steps.index("init_all_cuda_graphs")
    graphs = src[src.index("    def init_all_cuda_graphs(self):"):]
    assert graphs.index("self.tp_worker.init_cuda_graphs()") < graphs.index(
        "self.draft_worker.init_cuda_graphs()")


@OLD_ONLY
def test_graphed_metadata_hook_matches_the_method_it_wraps():
    """`sglang_tree_fa3meta` (DFLASH_TREE_FA3_GRAPH=1) wraps fa3's
    `_apply_cuda_graph_metadata`: the method exists with the keywords the hook reads, the
    decode graph runner's replay path calls it by keyword, its top-K > 1 TARGET_VERIFY branch
    reads no host value and of the round's spec input only the mask and the number of
    positions (so a graph over the runner's and backend's static buffers replays it), and it
    ends by setting the two Python attributes the hook restores after a replay."""
    import importlib.util
    import inspect
    from pathlib import Path

    from dflash_plugin.engines import sglang_tree_fa3meta as m

    mod, cls, meth = m.TARGET.rsplit(".", 2)
    spec = importlib.util.find_spec(mod)
    assert spec is not None and mod.endswith("flashattention_backend") and cls and meth
    src = Path(spec.origin).read_text()
    assert f"class {cls}(" in src and f"    def {meth}(" in src
    start = src.index(f"    def {meth}(")
    body = src[start:src.index("\n    def ", start + 10)]
    head = body[:body.index(")")]
    for name in ("bs", "req_pool_indices", "seq_lens", "seq_lens_sum", "encoder_lens",
                 "forward_mode", "spec_info", "seq_lens_cpu", "out_cache_loc"):
        assert f"        {name}:" in head, name
    caller = src[src.index("    def _init_full_cg_decode_metadata("):]
    caller = caller[:caller.index("\n    def ", 10)]
    assert "self._apply_cuda_graph_metadata(\n                bs=bs," in caller
    branch = body[body.index("# When topk > 1, we need two specific target verify metadata"):
                  body.index("elif forward_mode.is_draft_extend_v2():")]
    for sync in (".item()", ".cpu()", ".tolist()", "seq_lens_cpu", "seq_lens_sum", "out_cache_loc"):
        assert sync not in branch, sync
    uses = {u.split("(")[0].split("[")[0] for u in branch.split("spec_info.")[1:]}
    assert uses == {"positions.numel", "custom_mask"}, uses
    assert body.rstrip().endswith("self.forward_metadata = metadata\n"
                                  "        self.forward_metadata_spec_decode_expand = "
                                  "metadata_expand")
    assert "return [self.cuda_graph_custom_mask, None]" in src  # the buffer the gate compares
    assert inspect.signature(m.replay_metadata).parameters.keys() >= {"original", "backend"}


@OLD_ONLY
def test_graphed_metadata_hook_registers_once_and_reads_the_server_algorithm(monkeypatch):
    from sglang.srt.plugins.hook_registry import HookRegistry

    from dflash_plugin.engines import sglang_tree_fa3meta as m

    monkeypatch.setattr(HookRegistry, "_hooks", type(HookRegistry._hooks)(list))
    m.register_hook()
    m.register_hook()
    assert [h for _, h, _ in HookRegistry._hooks[m.TARGET]] == [m.replay_metadata]
    import sglang.srt.runtime_context as rc

    assert callable(rc.get_server_args)
    assert m._algorithm() is None or isinstance(m._algorithm(), str)
