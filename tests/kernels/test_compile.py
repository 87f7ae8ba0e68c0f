"""Ahead-of-time compile every kernel for an H100/H200 (sm_90) on this CPU machine.

Catches what the interpreter accepts but the compiler rejects (non-power-of-2 aranges, dtype
mismatches in loops, bad constexprs). Uses the ptxas bundled with triton; runs only in a process
where triton compiles (not under TRITON_INTERPRET=1). Written against triton 3.9's ASTSource."""

import inspect

import pytest

from tests.kernels._util import CUDA, INTERPRETED

pytestmark = pytest.mark.skipif(INTERPRETED or CUDA, reason="interpreted here, or a GPU compiles "
                                "the kernels for real in the other tests")
triton = pytest.importorskip("triton")


def compile_sm90(fn, types, consts):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    names = list(inspect.signature(fn.fn).parameters)
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                          target=GPUTarget("cuda", 90, 32))


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    try:
        from triton.backends.nvidia.compiler import get_ptxas  # noqa: F401
    except Exception as e:
        pytest.skip(f"no nvidia backend in this triton: {e!r}")


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_gate_kernels_compile(dtype):
    from specdec_kernels import gate
    i32 = "*i32"
    compile_sm90(gate._gate_kernel, {"h_ptr": f"*{dtype}", "parent_ptr": i32, "rho_ptr": "*fp32",
                                     "fold_ptr": "*i8", "delta": "fp32", "eps": "fp32"},
                 {"BR": 2, "BLOCK_D": 512})
    compile_sm90(gate._resolve_kernel, {"fold_ptr": "*i8", "parent_ptr": i32, "src_ptr": i32},
                 {"BLOCK": 256})
    compile_sm90(gate._compact_kernel, {"src_ptr": i32, "rows_ptr": i32, "rank_ptr": i32,
                                        "count_ptr": i32}, {"BLOCK": 1024})
    compile_sm90(gate._slot_kernel, {"src_ptr": i32, "rank_ptr": i32, "slot_ptr": i32},
                 {"BLOCK": 256})
    compile_sm90(gate._take_rows_kernel, {"x_ptr": f"*{dtype}", "idx_ptr": i32,
                                          "out_ptr": f"*{dtype}"}, {"BR": 2, "BLOCK_D": 512})


@pytest.mark.parametrize("flags", [
    dict(HAS_PREFIX=True, HAS_PVIS=True, HAS_BLOCK=True, HAS_MASK=True, STATE=True, G=4, D=128),
    dict(HAS_PREFIX=True, HAS_PVIS=False, HAS_BLOCK=False, HAS_MASK=False, STATE=False, G=3,
         D=64),
    dict(HAS_PREFIX=False, HAS_PVIS=False, HAS_BLOCK=True, HAS_MASK=True, STATE=True, G=1,
         D=64),
])
def test_attention_and_merge_compile(flags):
    from specdec_kernels import attention, merge
    bf, f32 = "*bf16", "*fp32"
    types = {"q_ptr": bf, "kc_ptr": bf, "vc_ptr": bf, "bt_ptr": "*i32", "plen_ptr": "*i32",
             "pvis_ptr": "*i32", "kb_ptr": bf, "vb_ptr": bf, "mask_ptr": "*i8", "out_ptr": bf,
             "m_ptr": f32, "l_ptr": f32, "qk_scale": "fp32"}
    consts = dict(PS=16, PREC="tf32", CPU=False, BM=64, BN=64, BD=flags["D"], **flags)
    k = compile_sm90(attention._branch_attn_kernel, types, consts)
    assert k.metadata.shared <= 228 * 1024
    compile_sm90(merge._merge_kernel, {"o_ptr": f32, "m_ptr": f32, "l_ptr": f32, "out_ptr": bf,
                                       "mo_ptr": f32, "lo_ptr": f32},
                 {"STATE": flags["STATE"], "BR": 16, "BD": flags["D"]})
    for has_idx in (True, False):  # SpecFold: fp32 partials merged into the model dtype
        compile_sm90(merge._merge_pair_kernel, {
            "oa_ptr": f32, "ma_ptr": f32, "la_ptr": f32, "ia_ptr": "*i32" if has_idx else f32,
            "ob_ptr": f32, "mb_ptr": f32, "lb_ptr": f32, "out_ptr": bf, "mo_ptr": f32,
            "lo_ptr": f32}, {"HAS_IDX": has_idx, "STATE": flags["STATE"], "BR": 32,
                             "BD": flags["D"]})


def test_specfold_fast_path_attention_compiles(g=4, d=128):
    """The three calls of specfold_plugin.fast_layers (Qwen3-8B heads): compact queries over the
    prefix with an fp32 state, every row over its own block (no mask) with an fp32 state, dense
    prefix + block."""
    from specdec_kernels import attention
    bf, f32 = "*bf16", "*fp32"
    for prefix, block, state in ((True, False, True), (False, True, True), (True, True, False)):
        out = f32 if state else bf
        types = {"q_ptr": bf, "kc_ptr": bf, "vc_ptr": bf, "bt_ptr": "*i32", "plen_ptr": "*i32",
                 "pvis_ptr": "*i32", "kb_ptr": bf, "vb_ptr": bf, "mask_ptr": "*i8",
                 "out_ptr": out, "m_ptr": f32, "l_ptr": f32, "qk_scale": "fp32"}
        consts = dict(PS=16, PREC="tf32", CPU=False, BM=64, BN=64, BD=d, G=g, D=d,
                      HAS_PREFIX=prefix, HAS_PVIS=False, HAS_BLOCK=block, HAS_MASK=False,
                      STATE=state)
        k = compile_sm90(attention._branch_attn_kernel, types, consts)
        assert k.metadata.shared <= 228 * 1024


@pytest.mark.parametrize("n,k,g", [(32, 4, 15), (8, 2, 7)])  # (64 nodes: 73 s more, same code)
def test_tree_kernels_compile(n, k, g):
    """The token-tree kernels at DFLASH_TREE's default shape (15 depths of top-4, 32 nodes)."""
    from specdec_kernels import tree_accept, tree_build
    from specdec_kernels._checks import next_pow2
    from specdec_kernels.tree_reference import beam_widths

    widths = beam_widths(g, k, n)
    i64, i32 = "*i64", "*i32"
    compile_sm90(tree_build._tree_build_kernel, {
        "lp_ptr": "*fp32", "ids_ptr": i64, "tok_ptr": i64, "par_ptr": i64, "dep_ptr": i64,
        "s_score": "*fp32", "s_par": i32, "s_tok": i64, "s_dep": i32, "s_flag": i32},
        {"G": len(widths), "K": k, "N": n, "BC": next_pow2(max(widths) * k),
         "CB": next_pow2(sum(widths))})
    w = n + 1
    for lens in (i64, i32):
        compile_sm90(tree_build._tree_tensors_kernel, {
            "tok_ptr": i64, "par_ptr": i64, "dep_ptr": i64, "root_ptr": i64, "lens_ptr": lens,
            "draft_ptr": i64, "pos_ptr": i64, "fpar_ptr": i64, "fdep_ptr": i64,
            "index_ptr": i64, "nxt_ptr": i64, "sib_ptr": i64, "anc_ptr": "*i1", "at_ptr": i64,
            "B": "i32"}, {"N": n, "D": g, "BW": next_pow2(w), "RB": min(next_pow2(w), 16),
                          "BB": 64})
    compile_sm90(tree_accept._tree_accept_kernel, {
        "choice_ptr": i64, "draft_ptr": i64, "par_ptr": i64, "loc_ptr": i64, "live_ptr": "*i1",
        "predict_ptr": i32, "path_ptr": i64, "n_ptr": i32, "bonus_ptr": i64, "tgt_ptr": i64,
        "src_ptr": i64}, {"W": w, "D": g, "BW": next_pow2(w), "BD": next_pow2(g + 1)})


def test_tree_rejection_kernel_compiles(n=32, k=4, g=15):
    """Recursive rejection sampling at DFLASH_TREE's default shape."""
    from specdec_kernels import tree_rejection
    from specdec_kernels._checks import next_pow2

    w, f32, i64 = n + 1, "*fp32", "*i64"
    compile_sm90(tree_rejection._tree_rejection_kernel, {
        "p_ptr": f32, "q_ptr": f32, "draft_ptr": i64, "par_ptr": i64, "u_ptr": f32,
        "ub_ptr": f32, "ws_ptr": f32, "path_ptr": i64, "acc_ptr": i64, "bonus_ptr": i64,
        "V": "i32"}, {"W": w, "D": g, "K": k, "BW": next_pow2(w), "BD": next_pow2(g + 1),
                      "BK": next_pow2(k), "BLOCK": 2048})
