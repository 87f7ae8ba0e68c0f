"""Batch-wide compaction of SpecFold's folded verify (issue 21 part 2), interpreter on CPU:
- `gate.compact_batch` (one capacity for all requests, row -> request map) vs the reference,
  overflow included (integer outputs exact; outputs poisoned before launch);
- `packed_attention` (ragged per-request prefix + own block) vs its torch reference: odd sizes,
  GQA, empty prefixes, unsorted rows, split-K, unused rows of a NaN-poisoned output buffer
  (fp32 1e-5, bf16 2e-2);
- the batch-wide folded forward (`shared=True`) equals the per-request one for 1 / 3 / 7
  requests with ragged prefixes, one tree per request and different recompute counts: fold
  counts exact, fp32 logits bitwise on the CPU (1e-5 on a GPU), also when the shared
  plan overflows (re-run), with sync (run-time sized) shared capacities and forced folds;
- `BatchCapacityPlanner` closed forms, `first_overflow` on sums."""

import math

import pytest
import torch
from specdec_kernels import reference as ref

from tests.kernels._util import CUDA, DEV, direct, poison_empty

pytestmark = direct
gate_mod = pytest.importorskip("specdec_kernels.gate")
pa = pytest.importorskip("specdec_kernels.packed_attention")
ff = pytest.importorskip("specfold_plugin.fold_fast")
fl = pytest.importorskip("specfold_plugin.fast_layers")

from tests.kernels.test_fold_fast import runner_at, shared_prefix, tiny_dllm  # noqa: E402
from tests.kernels.test_fold_kernels import forest_src  # noqa: E402


def same_logits(got, want):
    """fp32: bitwise equal on the CPU (same per-row math, observed exact); 1e-5 on a GPU, where
    the matmul kernel may change with the compact batch's row count."""
    if CUDA:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(got, want), float((got - want).nan_to_num().abs().max())


@pytest.mark.parametrize("segments,k,n,cap", [(1, 5, 7, 35), (3, 4, 5, 60), (3, 4, 5, 9),
                                              (7, 3, 11, 40), (2, 3, 11, 0), (4, 1, 3, 5)])
def test_compact_batch_matches_reference(monkeypatch, segments, k, n, cap):
    poison_empty(monkeypatch, gate_mod)
    src, _, _ = forest_src(segments, k, n, seed=segments * 7 + k)
    got = gate_mod.compact_batch(src.to(DEV), segments, cap)
    want = ref.compact_batch(src, segments, cap)
    for name, g, w in zip(["rows", "slot", "count", "row_request"], got, want):
        assert torch.equal(g.cpu(), w), name
    rows, slot, count, req = want
    per = k * n
    assert torch.equal(count, ref.compact(src, segments)[2])  # true per-request counts
    live = rows >= 0
    assert int(live.sum()) == min(cap, int(count.sum()))
    assert torch.equal(req[live], rows[live] // per) and (req[~live] == -1).all()
    assert (req[live].diff() >= 0).all()  # each request's rows next to each other
    assert bool((slot >= 0).all()) == (int(count.sum()) <= cap)


def paged(g, lens, ps, kvh, d, dtype):
    """A shuffled page pool holding each request's prefix; block table [requests, max_pages]."""
    pages = [max(1, -(-x // ps)) for x in lens]
    total = sum(pages) + 2  # two pages nobody uses
    kc = torch.randn(total, ps, kvh, d, generator=g).to(dtype)
    vc = torch.randn(total, ps, kvh, d, generator=g).to(dtype)
    perm = torch.randperm(total, generator=g)
    table = torch.full((len(lens), max(pages)), -1, dtype=torch.int32)
    start = 0
    for r, p in enumerate(pages):
        table[r, :p] = perm[start:start + p].to(torch.int32)
        start += p
    return kc, vc, table, torch.tensor(lens, dtype=torch.int32)


CASES = [  # rows, heads, kv_heads, dim, prefix lens, page size, block len
    (1, 1, 1, 16, [5], 4, 0),
    (13, 4, 2, 16, [0, 9, 33], 8, 5),
    (37, 6, 2, 33, [17, 1, 40, 0, 23], 16, 7),
    (21, 8, 8, 64, [3, 64], 16, 11),
]


@pytest.mark.parametrize("rows,h,kvh,d,lens,ps,bl", CASES)
@pytest.mark.parametrize("splits", [1, 3])
def test_packed_attention_matches_reference(monkeypatch, rows, h, kvh, d, lens, ps, bl, splits):
    poison_empty(monkeypatch, pa)  # NaN in every output buffer before launch
    g = torch.Generator().manual_seed(rows + d + splits)
    q = torch.randn(rows, h, d, generator=g)
    kc, vc, table, plen = paged(g, lens, ps, kvh, d, torch.float32)
    req = torch.randint(-1, len(lens), (rows,), generator=g, dtype=torch.int32)
    req = req.sort().values  # compaction order (sorted), -1 (unused) rows first here ...
    req[-1] = -1  # ... and an unused row at the end
    args = dict(row_request=req, k_cache=kc, v_cache=vc, block_table=table, prefix_lens=plen)
    if bl:
        nblk = 3
        kb = torch.randn(nblk, bl, kvh, d, generator=g)
        vb = torch.randn(nblk, bl, kvh, d, generator=g)
        rb = torch.randint(-1, nblk, (rows,), generator=g, dtype=torch.int32)
        mask = torch.rand(rows, bl, generator=g) < 0.6
        args.update(k_blk=kb, v_blk=vb, row_block=rb, blk_mask=mask)
    want = ref.packed_attention(q, **args, scale=0.3)
    got = pa.packed_attention(q.to(DEV), **{a: t.to(DEV) for a, t in args.items()}, scale=0.3,
                              num_splits=splits, block_m=16, block_n=16)
    for name, x, y in zip(["out", "m", "l"], got, want):
        assert not x.isnan().any(), name  # unused rows were written, not left poisoned
        torch.testing.assert_close(x.cpu(), y, rtol=1e-5, atol=1e-5, msg=name)
    blind = (req < 0) if not bl else (req < 0) & ((args["row_block"] < 0)
                                                 | ~args["blk_mask"].any(1))
    assert (got[0].cpu()[blind] == 0).all() and (got[1].cpu()[blind] == -math.inf).all()


def test_packed_attention_unsorted_rows_bf16_and_static_prefix():
    """Rows of requests interleaved (costs time only); bf16 in, fp32 partials out; a static
    prefix [requests, len, kvh, d] as pages of size len."""
    g = torch.Generator().manual_seed(3)
    r, h, kvh, d, length = 3, 4, 1, 32, 19
    kc = torch.randn(r, length, kvh, d, generator=g).to(torch.bfloat16)
    vc = torch.randn(r, length, kvh, d, generator=g).to(torch.bfloat16)
    table = torch.arange(r, dtype=torch.int32)[:, None]
    plen = torch.tensor([19, 4, 11], dtype=torch.int32)
    req = torch.tensor([2, 0, 1, 2, 0, -1, 1, 2, 0], dtype=torch.int32)
    q = torch.randn(len(req), h, d, generator=g).to(torch.bfloat16)
    args = dict(row_request=req, k_cache=kc, v_cache=vc, block_table=table, prefix_lens=plen)
    want = ref.packed_attention(q.float(), **{a: t.float() if t.is_floating_point() else t
                                              for a, t in args.items()})
    got = pa.packed_attention(q.to(DEV), **{a: t.to(DEV) for a, t in args.items()})
    assert got[0].dtype == torch.float32
    for x, y in zip(got, want):
        torch.testing.assert_close(x.cpu(), y, rtol=2e-2, atol=2e-2)


def test_packed_attention_bad_input_names_the_argument():
    q = torch.randn(4, 4, 16)
    kc = torch.randn(3, 4, 2, 16)
    table = torch.zeros(2, 2, dtype=torch.int32)
    plen = torch.tensor([3, 9], dtype=torch.int32)
    ok = dict(k_cache=kc, v_cache=kc, block_table=table, prefix_lens=plen)
    with pytest.raises(ValueError, match="row_request"):
        pa.packed_attention(q, torch.tensor([0, 1, 2, -1], dtype=torch.int32), **ok)
    with pytest.raises(ValueError, match="prefix_lens"):
        pa.packed_attention(q, torch.zeros(4, dtype=torch.int32), **{**ok, "prefix_lens":
                                                                     plen * 3})
    with pytest.raises(ValueError, match="k_cache / k_blk"):
        pa.packed_attention(q)
    with pytest.raises(ValueError, match="row_block"):
        pa.packed_attention(q, k_blk=kc, v_blk=kc)
    with pytest.raises(ValueError, match="capacity"):
        gate_mod.compact_batch(torch.zeros(4, 3, dtype=torch.int32), 2, 13)


TREES = [[-1, 0, 1, 1, 0, 4], [-1, 0, 0, 2, 3, 1], [-1, 0, 1, 2, 3, 4]]


def ragged_batch(model, requests, seed=0):
    """`requests` runners at ragged contexts (one empty, some not a whole page), a different
    tree and blocks per request -> batch, paged prefix pool, runners."""
    from spiffy_plugin.runtime import dllm_spec
    from tests.specfold.test_fold import branch_batch

    spec = dllm_spec(model.config)
    contexts = [(16, 0, 40, 8, 24, 32, 48)[(i + seed) % 7] for i in range(requests)]
    trees = [TREES[(i + seed) % 3] for i in range(requests)]
    blocks = torch.stack([branch_batch(spec, torch.Generator().manual_seed(seed * 10 + i), t)
                          for i, t in enumerate(trees)])
    runners = [runner_at(model, c, b, seed=i) for i, (c, b) in enumerate(zip(contexts, blocks))]
    prefix = shared_prefix(runners, spec.block_size) if any(contexts) else None
    return fl.prepare(model, blocks, trees, contexts), prefix


@pytest.mark.parametrize("requests", [1, 3, 7])
def test_batch_wide_equals_per_request(requests):
    model = tiny_dllm()
    layers, delta = model.config.num_hidden_layers, 0.2
    batch, prefix = ragged_batch(model, requests, seed=requests)
    per, total = batch.branches * batch.n, requests * batch.branches * batch.n
    with torch.inference_mode():
        want, counts, rerun = ff.folded_exact(model, batch, prefix, delta, [(per, per)] * layers)
        assert rerun == 0
        sums = counts.sum(-1)  # [layers, 2]
        assert int(sums.max()) < total  # really folded
        if requests > 1:  # different recompute counts per request
            assert (counts.amax(-1) != counts.amin(-1)).any()
        # a shared plan that equals the sums (rounded up to 8): no re-run, same result
        tight = [tuple(min(total, -(-int(c) // 8) * 8) for c in lc) for lc in sums]
        got, got_counts, rerun = ff.folded_exact(model, batch, prefix, delta, tight, shared=True)
        assert rerun == 0 and torch.equal(got_counts, counts)
        same_logits(got, want)
        # too small: the FFN gate of layer 1 overflows, layers 1.. re-run wider, same result
        small = tight[:1] + [(tight[1][0], int(sums[1, 1]) - 1)] + tight[2:]
        got, got_counts, rerun = ff.folded_exact(model, batch, prefix, delta, small, shared=True)
        assert rerun == layers - 1 and torch.equal(got_counts, counts)
        same_logits(got, want)
        if requests == 3:  # sync capacities, shared: sized from the sums at run time
            got, got_counts, rerun = ff.folded_exact(model, batch, prefix, delta,
                                                     [(None, None)] * layers, shared=True)
            assert rerun == 0 and torch.equal(got_counts, counts)
            same_logits(got, want)


def test_batch_wide_forced_folds_and_layer_gate():
    """Forced fold sets (the benchmark's 8B path) and one gate per layer, shared vs per
    request."""
    model = tiny_dllm()
    layers = model.config.num_hidden_layers
    batch, prefix = ragged_batch(model, 3, seed=2)
    per, total = batch.branches * batch.n, 3 * batch.branches * batch.n
    g = torch.Generator().manual_seed(0)
    roots = (torch.arange(3 * batch.branches) % batch.branches == 0)[:, None]
    forced = [tuple(((torch.rand(3 * batch.branches, batch.n, generator=g) < 0.6) & ~roots)
                    .to(DEV) for _ in range(2)) for _ in range(layers)]
    with torch.inference_mode():
        for ffn_gate in ("own", "layer"):
            want, counts, _ = ff.folded_exact(model, batch, prefix, 0.1, [(per, per)] * layers,
                                              ffn_gate, forced)
            caps = [(total - 8, total - 8)] * layers
            got, got_counts, rerun = ff.folded_exact(model, batch, prefix, 0.1, caps, ffn_gate,
                                                     forced, shared=True)
            assert rerun == 0 and torch.equal(got_counts, counts)
            same_logits(got, want)


def test_batch_planner_closed_form():
    p = ff.BatchCapacityPlanner(granule=4, z=2.0, margin=0.0, window=4)
    assert p.plan(2, 8, 1, requests=3) == [(48, 48)]  # nothing seen: every row
    c1 = torch.tensor([[[8, 4], [4, 4]]])  # [layers 1, 2 gates, 2 requests]: shares .5/.25, .25
    c2 = torch.tensor([[[12, 4], [8, 8]]])  # shares .75 / .25, .5 / .5
    p.update(2, 8, c1)
    assert p.plan(2, 8, 1) == [(16, 16)]  # min_seen 2
    p.update(2, 8, c2)
    # attention gate: shares .5 .25 | .75 .25 -> mu .4375; within-forward var .03125 / .125
    # -> s_w2 .078125; forward means .375 / .5 -> var .0078125 - s_w2 / 2 < 0 -> s_b2 0
    for r in (1, 4):
        sd_a = math.sqrt(r * 0.078125)
        sd_f = math.sqrt(r * r * 0.03125)  # within 0; forward means .25 / .5
        want_a = 16 * r * 0.4375 + 2 * 16 * sd_a
        want_f = 16 * r * (4 + 4 + 8 + 8) / 64 + 2 * 16 * sd_f
        caps = p.plan(2, 8, 1, requests=r)
        assert caps == [tuple(min(16 * r, 4 * math.ceil(x / 4)) for x in (want_a, want_f))]
    # the relative spread of the planned sum falls with the number of requests
    share = [sum(p.plan(2, 8, 1, requests=r)[0]) / (2 * 16 * r) for r in (1, 16)]
    assert share[1] < share[0]
    with pytest.raises(ValueError, match="window"):
        ff.BatchCapacityPlanner(window=1)
    with pytest.raises(ValueError, match="z"):
        ff.BatchCapacityPlanner(z=-1)


def test_single_request_forward_with_the_batch_planner():
    """`folded_forward_fast` takes the batch planner (shared capacities, one request): same
    logits as every row; after two forwards the plan is smaller than every row and holds."""
    from specfold_plugin.stats import FoldStats
    from spiffy_plugin.runtime import dllm_spec
    from tests.specfold.test_fold import branch_batch

    model = tiny_dllm()
    spec = dllm_spec(model.config)
    parents = TREES[0]
    blocks = branch_batch(spec, torch.Generator().manual_seed(5), parents)
    runner = runner_at(model, 16, blocks)
    want = ff.folded_forward_fast(runner, blocks, parents, 0.2)
    planner = ff.BatchCapacityPlanner(granule=8, z=1.0)
    for _ in range(3):
        stats = FoldStats(model.config.num_hidden_layers)
        same_logits(ff.folded_forward_fast(runner, blocks, parents, 0.2, stats,
                                           planner=planner), want)
    assert stats.reruns == 0
    full = len(parents) * spec.block_size
    assert max(map(max, planner.plan(len(parents), spec.block_size, 3))) < full
    one = ff.BatchCapacityPlanner(min_seen=1)
    one.update(2, 8, torch.tensor([[[8], [4]]]))
    assert one.plan(2, 8, 1) == [(16, 16)]  # one forward, one request: no spread, no NaN


def test_first_overflow_on_sums():
    counts = torch.tensor([[[5, 9], [5, 9]], [[7, 1], [2, 2]]])  # [layers, 2, requests]
    assert ff.first_overflow(counts, [(8, 9), (8, 8)]) == 0  # per request: 9 > 8
    assert ff.first_overflow(counts, [(14, 14), (8, 4)], shared=True) is None
    assert ff.first_overflow(counts, [(14, 14), (7, 4)], shared=True) == 1
