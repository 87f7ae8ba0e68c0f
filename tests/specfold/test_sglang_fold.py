"""SpecFold's SGLang fold plan without SGLang: the batch-wide gate over several requests' trees
(`fold_rows`) against the reference gate per tree, and the layer hook's dispatch (folded only
while a plan for this very batch is active). The folded layer itself runs in SGLang's server:
`tests/engines/test_sglang_serve.py`."""

from types import SimpleNamespace

import torch

from specfold_plugin.engines import sglang_fold
from specfold_plugin.engines.sglang_fold import FoldPlan, Group, active, fold_forward, fold_rows
from specfold_plugin.gate import gate, resolve_sources
from specfold_plugin.stats import FoldStats


def _batch(n: int = 4, d: int = 8):
    """Two requests: roots at sequences 0, 1; request 0's drafts at 2, 3, 4 (a chain and a
    sibling), request 1's at 5. Some draft positions repeat their parent's input exactly."""
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(6, n, d, generator=gen)
    for child, parent, pos in ((2, 0, [0, 1]), (3, 2, [0, 1, 2]), (4, 0, [3]), (5, 1, [0, 2])):
        h[child, pos] = h[parent, pos]
    h[3, 3] = h[2, 3] * 1.05  # close: folds for delta 0.1, not for 0
    groups = [Group(torch.tensor([0, 2, 3, 4]), torch.tensor([-1, 0, 1, 0])),
              Group(torch.tensor([1, 5]), torch.tensor([-1, 0]))]
    return h, groups


def test_fold_rows_follow_each_requests_tree():
    h, groups = _batch()
    w = torch.randn(h.shape[-1], 5, generator=torch.Generator().manual_seed(1))
    for delta in (0.0, 0.1):
        plan = FoldPlan(6, 4, delta, groups)
        rows, take, fold = fold_rows(h.reshape(-1, h.shape[-1]), plan)
        got = (h.reshape(-1, h.shape[-1])[rows] @ w)[take].view(6, 4, 5)  # folded projection
        want_src = torch.arange(6)[:, None].repeat(1, 4)
        for g in groups:  # the reference gate and resolution, per tree
            f = gate(h[g.seqs], g.parents, delta)
            want_src[g.seqs] = g.seqs[resolve_sources(f, g.parents)]
            assert torch.equal(fold[g.seqs], f)
        want = torch.stack([torch.stack([h[want_src[s, p], p] for p in range(4)])
                            for s in range(6)]) @ w
        torch.testing.assert_close(got, want)
        assert not fold[:2].any()  # roots never fold
        assert len(rows) == int((~fold).sum()) < 24
        assert bool(fold[3, 3]) == (delta > 0)
    assert want_src[3, 1] == 0  # a fold chain resolves to the nearest recomputed ancestor


def test_hook_folds_only_under_a_plan_for_this_batch(monkeypatch):
    calls = []
    monkeypatch.setattr(sglang_fold, "folded_block",
                        lambda layer, pos, hs, fb, plan: calls.append(("folded", plan)) or "f")
    layer = object()

    def own(self, pos, hs, fb):  # SDARBlock.forward as the HookRegistry hands it over
        assert self is layer
        calls.append(("own",))
        return "o"

    def fwd(pos, fb):
        return fold_forward(own, layer, pos, None, fb)

    fb, pos = SimpleNamespace(batch_size=6), torch.zeros(24, dtype=torch.long)
    assert fwd(pos, fb) == "o"  # Spiffy / no drafts: untouched
    plan = FoldPlan(6, 4, 0.1, _batch()[1])
    copy = SimpleNamespace(batch_size=6)  # SGLang's eager runner hands layers a copy
    with active(fb, plan):
        assert fwd(pos, fb) == "f" and fwd(pos, copy) == "f"
        assert fwd(pos[:8], SimpleNamespace(batch_size=2)) == "o"  # another batch
    assert fwd(pos, fb) == "o"
    assert [c[0] for c in calls] == ["own", "folded", "folded", "own", "own"]


def test_counters_per_forward_and_per_request():
    h, groups = _batch()
    for g in groups:
        g.stats = FoldStats(1)
        g.stats.add_forward(len(g.seqs) * 4, 4, 0)
    plan = FoldPlan(6, 4, 0.0, groups, stats=FoldStats(1))
    plan.stats.add_forward(24, 8, 0)
    rows, _, fold = fold_rows(h.reshape(24, -1), plan)
    sglang_fold._count(plan, fold, fold, len(rows), len(rows))
    assert plan.layers_run == 1 and plan.stats.qkv_rows == [24 - int(fold.sum())]
    assert groups[0].stats.qkv_rows == [16 - int(fold[[0, 2, 3, 4]].sum())]
    assert groups[1].stats.fold_ratio("qkv", drafts_only=True) == 0.5  # 2 of 4 draft rows
