"""Folded verification on the real code-dllm fixture: delta = 0 equals Spiffy's dense verification
(fp32 logits within 1e-4, token-identical generation); folded rows really skip QKV and the FFN;
agreement at delta > 0 (an approximation) is printed, never grows with delta and is full at the
smallest delta; bad input."""

import pytest
import torch
from specdec_kernels.qwen3 import Ops
from torch.nn import functional as F

from specfold_plugin.cli import main as specfold_main
from specfold_plugin.fold import folded_forward
from specfold_plugin.specfold import (
    FoldedVerify,
    agreement_summary,
    specfold_generate,
    token_agreement,
)
from specfold_plugin.stats import FoldStats, projected_flops
from spiffy_plugin.decode import DecodeParams
from spiffy_plugin.errors import ConfigError
from spiffy_plugin.graph import is_parent
from spiffy_plugin.runtime import BlockDiffusionRunner, dllm_spec
from spiffy_plugin.spiffy import branch_parents, spiffy_generate
from tests.spiffy.test_runtime import dllm  # noqa: F401 (module fixture)
from tests.spiffy.test_spiffy import EVAL, graphs  # noqa: F401 (module fixture)

TOL = dict(rtol=1e-4, atol=1e-4)  # fp32, CPU: dense SDPA vs streamed states, row subsets


def branch_batch(spec, gen, parents, changed_from=6):
    """A root with a masked tail and drafts that each unmask one more position of their parent."""
    bs = spec.block_size
    root = torch.randint(3, 16000, (bs,), generator=gen)
    root[changed_from:] = spec.mask_token_id
    blocks = [root]
    for i, p in enumerate(parents[1:], 1):
        b = blocks[p].clone()
        tok = int(torch.randint(3, 16000, (1,), generator=gen))
        b[changed_from + i % (bs - changed_from)] = tok
        blocks.append(b)
    return torch.stack(blocks)


@pytest.mark.parametrize("context_blocks", [0, 2])
def test_delta_zero_equals_dense_verification(dllm, context_blocks):  # noqa: F811
    model, _ = dllm
    spec = dllm_spec(model.config)
    gen = torch.Generator().manual_seed(context_blocks)
    parents = [-1, 0, 1, 1, 0, 4, 5, 2]  # chains of depth 3 and siblings
    blocks = branch_batch(spec, gen, parents)
    ctx = torch.randint(3, 16000, (context_blocks * spec.block_size,), generator=gen)
    runner = BlockDiffusionRunner(model, spec)
    runner.forward(ctx, blocks[:1])
    dense = runner.forward(ctx[:0], blocks)
    stats = FoldStats(model.config.num_hidden_layers)
    folded = folded_forward(runner, blocks, parents, 0.0, stats)
    assert runner.nfe == 3 and runner.cached == len(ctx)
    torch.testing.assert_close(folded, dense, **TOL)
    # Identical layer-0 inputs (unchanged tokens) fold: the fold path itself is what was checked.
    assert stats.qkv_rows[0] < stats.rows and stats.fold_ratio("qkv") > 0


def test_branch_parents_follow_the_graph(dllm, graphs):  # noqa: F811
    g = graphs[8]
    kept = list(range(len(g.nodes)))  # calibration order is a valid keep order
    parents = branch_parents(g, kept)
    assert parents[0] == -1
    for b, k in enumerate(kept, 1):
        assert 0 <= parents[b] < b
        node = g.nodes[k]
        if parents[b] == 0:
            assert node.depth == 1 or not any(is_parent(g.nodes[j], node) for j in kept[:b - 1])
        else:
            assert is_parent(g.nodes[kept[parents[b] - 1]], node)


@pytest.mark.parametrize("budget,keep", [(3, None), (8, None), (8, 4)])
@pytest.mark.parametrize("prompt", EVAL)
def test_delta_zero_generation_is_token_identical(dllm, graphs, budget, keep, prompt):  # noqa: F811
    model, tok = dllm
    ids = tok(prompt).input_ids
    ref = spiffy_generate(model, ids, graphs[budget], DecodeParams(), 40, keep=keep)
    got = specfold_generate(model, ids, graphs[budget], DecodeParams(), 40, keep=keep, delta=0.0)
    assert got.tokens == ref.tokens and got.nfe == ref.nfe and got.steps == ref.steps
    assert got.fold is not None and got.fold.forwards > 0


def test_folded_rows_skip_qkv_and_ffn(dllm):  # noqa: F811
    model, _ = dllm
    spec = dllm_spec(model.config)
    gen = torch.Generator().manual_seed(5)
    parents = [-1, 0, 0, 1, 3, 2]
    blocks = branch_batch(spec, gen, parents)
    runner = BlockDiffusionRunner(model, spec)
    runner.forward(torch.randint(3, 16000, (spec.block_size,), generator=gen), blocks[:1])
    layers = model.model.layers
    seen = {"qkv": [], "gate_up": [], "o": []}

    def linear(x, w, b=None):  # the layer's matmul hook: rows through each projection
        for m in layers:  # parameters are views of the fused matrices: match by address
            a = m.self_attn
            qkv = a.q_proj.out_features + a.k_proj.out_features + a.v_proj.out_features
            gate_up = 2 * m.mlp.up_proj.out_features
            for name, p, out in (("qkv", a.q_proj.weight, qkv),
                                 ("gate_up", m.mlp.gate_proj.weight, gate_up),
                                 ("o", a.o_proj.weight, a.o_proj.out_features)):
                if w.data_ptr() == p.data_ptr():
                    assert w.shape[0] == out  # q, k and v (gate and up) in one matmul
                    seen[name].append(x.reshape(-1, x.shape[-1]).shape[0])
        return F.linear(x, w, b)

    stats = FoldStats(len(layers))
    folded_forward(runner, blocks, parents, 0.3, stats, ops=Ops(linear=linear))
    total = len(parents) * spec.block_size
    assert seen["qkv"] == stats.qkv_rows
    assert seen["gate_up"] == stats.ffn_rows
    assert seen["o"] == [total] * len(layers)  # o_proj runs on every row
    assert sum(stats.qkv_rows) < total * len(layers) and sum(stats.ffn_rows) < total * len(layers)
    assert min(stats.qkv_rows) >= spec.block_size  # the root is always recomputed
    flops = projected_flops(model.config, stats, spec.block_size)
    assert 0 < flops["folded"] < flops["dense"]


def test_agreement_grows_as_delta_shrinks(dllm, graphs, capsys):  # noqa: F811
    model, tok = dllm
    ids = tok(EVAL[0]).input_ids
    ref = spiffy_generate(model, ids, graphs[8], DecodeParams(), 40)
    ratios, agreement = [], []
    for delta in (0.05, 0.1, 0.3):
        got = specfold_generate(model, ids, graphs[8], DecodeParams(), 40, delta=delta)
        same, total = token_agreement(got.tokens, ref.tokens)
        ratios.append(got.fold.fold_ratio("qkv"))
        with capsys.disabled():
            print(f"\n[specfold] delta {delta}: agreement {same}/{total}, NFE {got.nfe} vs "
                  f"{ref.nfe}, {got.fold.summary()}")
        assert 0 < len(got.tokens) <= 40 == len(ref.tokens)  # max_new_tokens caps both
        agreement.append(same / total)
    assert agreement == sorted(agreement, reverse=True)  # exact ratios of token counts
    assert agreement[0] == 1.0  # delta 0.05: token-identical to Spiffy on this fixture
    assert ratios == sorted(ratios) and ratios[-1] > 0


def test_bad_input(dllm, graphs, capsys):  # noqa: F811
    model, tok = dllm
    ids = tok(EVAL[0]).input_ids
    for delta in (-0.1, float("nan")):
        with pytest.raises(ConfigError, match="delta"):
            specfold_generate(model, ids, graphs[3], DecodeParams(), 8, delta=delta)
    with pytest.raises(ConfigError, match="ffn_gate"):
        FoldedVerify(0.1, ffn_gate="both")
    spec = dllm_spec(model.config)
    runner = BlockDiffusionRunner(model, spec)
    blocks = torch.full((2, spec.block_size), spec.mask_token_id)
    with pytest.raises(ConfigError, match="parents"):
        folded_forward(runner, blocks, [-1], 0.1)
    with pytest.raises(ConfigError, match="parents"):
        folded_forward(runner, blocks, [-1, 1], 0.1)
    assert runner.nfe == 0
    assert specfold_main(["generate", "--model", "x", "--graph", "g.json", "--prompt", "a",
                          "--delta", "-1"]) == 2
    assert "delta" in capsys.readouterr().err


def test_cli_generate_and_compare(graphs, tmp_path, capsys):  # noqa: F811
    from tests.spiffy.test_runtime import DLLM

    graphs[3].save(tmp_path / "g.json")
    rc = specfold_main(["generate", "--model", str(DLLM), "--graph", str(tmp_path / "g.json"),
                        "--prompt", EVAL[0], "--max-new-tokens", "24", "--delta", "0",
                        "--compare"])
    out = capsys.readouterr().out
    assert rc == 0 and out.startswith(EVAL[0])
    assert "folded rows: QKV" in out and "24/24 tokens agree (100.0%)" in out


def test_stats_merge_adds_counters():
    a, b = FoldStats(2), FoldStats(2)
    a.add_forward(32, 16, 10)
    a.add_layer(0, 40, 30, 10)
    b.add_forward(48, 16, 20)
    b.add_layer(1, 50, 16, 20)
    a.merge(b)
    assert (a.forwards, a.rows, a.root_rows) == (2, 80, 32)
    assert a.qkv_rows == [40, 50] and a.ffn_rows == [30, 16]
    assert a.prefix_qk_dense == 32 * 10 + 48 * 20 and a.prefix_qk_folded == 400 + 1000
    assert a.fold_ratio("qkv") == pytest.approx(1 - 90 / 160)
    assert a.fold_ratio("qkv", drafts_only=True) == pytest.approx(1 - (90 - 64) / (160 - 64))


def test_agreement_summary_counts_tokens_at_the_same_index():
    outs = [[1, 2, 3, 4], [5, 6], [7, 8, 9]]
    refs = [[1, 2, 3, 4], [5, 9, 6], [8, 7, 9]]  # shifted / swapped: later tokens count against
    assert agreement_summary(outs, refs) == {"agreement": round(6 / 10, 4),
                                             "identical_prompts": 1, "prompts": 3}
