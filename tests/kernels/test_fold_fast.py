"""SpecFold's folded forward on the Triton kernels (`specfold_plugin.fold_fast`) against the torch
reference (`fold.folded_forward`) and dense verification, fp32 on CPU in the interpreter (see
conftest.py; compiled on a GPU). Tolerance: fp32 logits atol = rtol = 1e-4 (streamed states and
other summation orders, as in tests/specfold). Fold sets must be identical (per-layer counts).
- delta = 0 equals dense (Spiffy) verification; the kernels' dense forward does too;
- delta > 0 equals the reference (both FFN gates), also with tight planned capacities, and a plan
  too small re-runs and still gives the same logits;
- several requests in one batch (ragged contexts, one empty) equal one request at a time;
- greedy `specfold_generate` is token-identical between the backends (fixture, 2 dev prompts)."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

from specfold_plugin.fold import folded_forward
from specfold_plugin.stats import FoldStats
from spiffy_plugin.calibrate import calibrate
from spiffy_plugin.cli import read_prompts
from spiffy_plugin.decode import DecodeParams
from spiffy_plugin.runtime import BlockDiffusionRunner, dllm_spec
from tests.kernels._util import CUDA, DEV, direct
from tests.specfold.test_fold import branch_batch
from tests.spiffy.test_runtime import DLLM
from tests.spiffy.test_spiffy import CALIB

ROOT = Path(__file__).resolve().parents[2]

pytestmark = direct
ff = pytest.importorskip("specfold_plugin.fold_fast")
fl = pytest.importorskip("specfold_plugin.fast_layers")

TOL = dict(rtol=1e-4, atol=1e-4) if not CUDA else dict(rtol=2e-4, atol=2e-4)
PARENTS = [-1, 0, 1, 1, 0, 4]


def tiny_dllm(block=8):
    cfg = Qwen3Config(hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, intermediate_size=96, vocab_size=16384,
                      max_position_embeddings=128, pad_token_id=1, eos_token_id=None,
                      bos_token_id=None)
    cfg.dllm_block_size, cfg.mask_token_id = block, 3
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval().to(DEV)


@pytest.fixture(scope="module")
def fixture_model():
    tok = AutoTokenizer.from_pretrained(DLLM)
    return AutoModelForCausalLM.from_pretrained(DLLM, dtype=torch.float32).eval().to(DEV), tok


def runner_at(model, context, blocks, seed=0):
    spec = dllm_spec(model.config)
    gen = torch.Generator().manual_seed(seed)
    runner = BlockDiffusionRunner(model, spec)
    runner.forward(torch.randint(4, spec.vocab_size, (context,), generator=gen), blocks[:1])
    return runner


@pytest.mark.parametrize("context_blocks", [0, 2])
def test_delta_zero_equals_dense_verification(fixture_model, context_blocks):
    model, _ = fixture_model
    spec = dllm_spec(model.config)
    blocks = branch_batch(spec, torch.Generator().manual_seed(context_blocks), PARENTS)
    runner = runner_at(model, context_blocks * spec.block_size, blocks)
    with torch.inference_mode():
        dense = runner.forward(blocks[:1, :0].reshape(0), blocks)
    stats = FoldStats(model.config.num_hidden_layers)
    got = ff.folded_forward_fast(runner, blocks, PARENTS, 0.0, stats)
    torch.testing.assert_close(got, dense, **TOL)
    assert stats.qkv_rows[0] < stats.rows  # identical layer-0 inputs really folded
    torch.testing.assert_close(ff.dense_forward_fast(runner, blocks), dense, **TOL)
    assert runner.nfe == 4


@pytest.mark.parametrize("delta,ffn_gate", [(0.1, "own"), (0.3, "layer")])
def test_kernel_path_equals_reference(fixture_model, delta, ffn_gate):
    model, _ = fixture_model
    spec = dllm_spec(model.config)
    blocks = branch_batch(spec, torch.Generator().manual_seed(7), PARENTS)
    runner = runner_at(model, 2 * spec.block_size, blocks)
    layers = model.config.num_hidden_layers
    s_ref, s_fast, s_plan = FoldStats(layers), FoldStats(layers), FoldStats(layers)
    want = folded_forward(runner, blocks, PARENTS, delta, s_ref, ffn_gate)
    planner = ff.CapacityPlanner(granule=8, margin=0.0)
    got = ff.folded_forward_fast(runner, blocks, PARENTS, delta, s_fast, ffn_gate, planner)
    assert (s_fast.qkv_rows, s_fast.ffn_rows) == (s_ref.qkv_rows, s_ref.ffn_rows)
    assert s_ref.fold_ratio("qkv") > 0.2 and s_ref.fold_ratio("ffn") > 0.2
    torch.testing.assert_close(got, want, **TOL)
    caps = planner.plan(len(PARENTS), spec.block_size, layers)
    assert max(c for lc in caps for c in lc) < len(PARENTS) * spec.block_size  # really compact
    again = ff.folded_forward_fast(runner, blocks, PARENTS, delta, s_plan, ffn_gate, planner)
    assert s_plan.reruns == 0 and s_plan.qkv_rows == s_ref.qkv_rows
    torch.testing.assert_close(again, want, **TOL)
    s_sync = FoldStats(layers)  # capacities sized from each gate's true count
    synced = ff.folded_forward_fast(runner, blocks, PARENTS, delta, s_sync, ffn_gate,
                                    ff.SyncCapacities())
    assert s_sync.reruns == 0 and (s_sync.qkv_rows, s_sync.ffn_rows) == (s_ref.qkv_rows,
                                                                         s_ref.ffn_rows)
    torch.testing.assert_close(synced, want, **TOL)


def test_too_small_plan_reruns_and_stays_exact():
    model = tiny_dllm()
    spec = dllm_spec(model.config)
    blocks = branch_batch(spec, torch.Generator().manual_seed(1), PARENTS)
    runner = runner_at(model, 16, blocks)
    layers = model.config.num_hidden_layers
    want = ff.folded_forward_fast(runner, blocks, PARENTS, 0.2)
    ref_stats = FoldStats(layers)
    ref = folded_forward(runner, blocks, PARENTS, 0.2, ref_stats)
    torch.testing.assert_close(want, ref, **TOL)
    assert sum(ref_stats.qkv_rows) < layers * len(PARENTS) * spec.block_size
    batch = fl.prepare(model, blocks[None], PARENTS, [runner.cached])
    n = spec.block_size
    caps = [(n, n)] * layers  # room for the root only: layer 0 overflows
    logits, counts, rerun = ff.folded_exact(model, batch, fl.runner_prefix(runner), 0.2, caps)
    assert rerun == layers and counts[:, 0, 0].tolist() == ref_stats.qkv_rows
    spec_logits = logits.view(len(PARENTS), n, -1)
    spec_logits[..., list(spec.banned_token_ids)] = float("-inf")
    torch.testing.assert_close(spec_logits, ref, **TOL)


def shared_prefix(runners, page_size):
    """One paged pool holding every runner's committed cache (request r's pages in order)."""
    layers = len(runners[0].cache.layers)
    pages = [r.cached // page_size for r in runners]
    table = torch.zeros(len(runners), max(max(pages), 1), dtype=torch.int32)
    keys, values = [], []
    for i in range(layers):
        ks, vs = [], []
        for r in runners:
            if r.cached:
                ks.append(fl.cache_pages(r.cache.layers[i].keys, r.cached, page_size))
                vs.append(fl.cache_pages(r.cache.layers[i].values, r.cached, page_size))
        keys.append(torch.cat(ks).contiguous())
        values.append(torch.cat(vs).contiguous())
    start = 0
    for j, p in enumerate(pages):
        table[j, :p] = torch.arange(start, start + p)
        start += p
    lens = torch.tensor([r.cached for r in runners], dtype=torch.int32)
    return fl.Prefix(keys, values, table.to(DEV), lens.to(DEV))


def test_batched_requests_equal_one_at_a_time():
    model = tiny_dllm()
    spec = dllm_spec(model.config)
    n, layers = spec.block_size, model.config.num_hidden_layers
    contexts = [16, 0, 40]
    blocks = torch.stack([branch_batch(spec, torch.Generator().manual_seed(s), PARENTS)
                          for s in range(3)])
    runners = [runner_at(model, c, b, seed=i) for i, (c, b) in enumerate(zip(contexts, blocks))]
    stats = [FoldStats(layers) for _ in runners]
    singles = [folded_forward(r, b, PARENTS, 0.2, st) for r, b, st in zip(runners, blocks, stats)]
    batch = fl.prepare(model, blocks, PARENTS, contexts)
    full = len(PARENTS) * n
    caps = [(full - n, full)] * layers
    with torch.inference_mode():
        logits, counts, _ = ff.folded_exact(model, batch, shared_prefix(runners, n), 0.2, caps)
    with torch.inference_mode():  # sized per gate from the largest request's count
        synced, sync_counts, rerun = ff.folded_exact(model, batch, shared_prefix(runners, n),
                                                     0.2, [(None, None)] * layers)
    assert rerun == 0 and torch.equal(sync_counts, counts)
    assert int(counts[0].amax()) < full  # layer 0 really runs a smaller batch than every row
    torch.testing.assert_close(synced, logits, **TOL)
    logits = logits.view(3, len(PARENTS), n, -1)
    for r in range(3):
        assert counts[:, 0, r].tolist() == stats[r].qkv_rows
        assert counts[:, 1, r].tolist() == stats[r].ffn_rows
        got = logits[r].clone()
        got[..., list(spec.banned_token_ids)] = float("-inf")
        torch.testing.assert_close(got, singles[r], **TOL)
    with torch.inference_mode():  # dense on the kernels, batched: equals the runtime's dense
        h, _, _ = fl.run_layers(model, model.model.embed_tokens(batch.ids), batch,
                                shared_prefix(runners, n), None, None)
        dense = fl.logits_of(model, h).view(3, len(PARENTS), n, -1)
        for r, run in enumerate(runners):
            want = run.forward(blocks[r, :1, :0].reshape(0), blocks[r])
            got = dense[r].clone()
            got[..., list(spec.banned_token_ids)] = float("-inf")
            torch.testing.assert_close(got, want, **TOL)


def test_greedy_generation_identical_between_backends(fixture_model):
    from specfold_plugin.specfold import specfold_generate
    model, tok = fixture_model
    graph = calibrate(model, [tok(p).input_ids for p in CALIB[:2]], 4, max_new_tokens=16)
    dev_prompts = read_prompts(ROOT / "examples" / "fixtures" / "dev-prompts.jsonl")
    for prompt in (dev_prompts[4], dev_prompts[1]):  # 206 and 302 tokens
        ids = tok(prompt).input_ids
        out = {b: specfold_generate(model, ids, graph, DecodeParams(), 8, keep=3, delta=0.1,
                                    backend=b) for b in ("torch", "triton")}
        out["plan"] = specfold_generate(model, ids, graph, DecodeParams(), 8, keep=3, delta=0.1,
                                        backend="triton", capacity="plan")
        assert out["triton"].tokens == out["torch"].tokens == out["plan"].tokens
        assert out["plan"].fold.qkv_rows == out["torch"].fold.qkv_rows
        assert out["triton"].nfe == out["torch"].nfe
        ft, fr = out["triton"].fold, out["torch"].fold
        assert (ft.qkv_rows, ft.ffn_rows) == (fr.qkv_rows, fr.ffn_rows)
        assert fr.forwards >= 2 and fr.fold_ratio("qkv") > 0
