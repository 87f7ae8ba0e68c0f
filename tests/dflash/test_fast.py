"""The fast runtime (`dflash_plugin.fast`) against the reference path, on CPU in fp32 without
graphs: cache bookkeeping (ragged prefill, append, crop by length), drafter math, and
token-identical generation (DFlash, n-gram, plain AR), plus a `gpu` test of the CUDA graphs."""

import pytest
import torch

from dflash_plugin.errors import ConfigError
from dflash_plugin.fast import build_decoder, fast_generate, supports
from dflash_plugin.fast.accept import accept_round, compile_steps
from dflash_plugin.fast.attention import plan, resolve_backend
from dflash_plugin.fast.cache import StaticKVCache
from dflash_plugin.fast.drafter import context_write, draft_block
from dflash_plugin.fast.qwen3 import target_forward
from dflash_plugin.generate import speculative_generate
from dflash_plugin.ngram import NgramProposer
from dflash_plugin.proposers import DFlashProposer
from dflash_plugin.target import context_features
from tests.conftest import fitted_drafter, greedy_reference, tiny_target

# the first prompt is one the drafter was fitted on (long accepts); the others are ragged
PROMPTS = [[5, 17, 29, 41], [9, 8, 7, 6, 5, 4], [11, 12], [20, 30, 40, 50, 60, 70, 80]]


@pytest.fixture(scope="module")
def pair(qwen3_target):
    return qwen3_target, fitted_drafter(qwen3_target, num_layers=1, block_size=8)


def test_cache_write_crop_commit():
    c = StaticKVCache(1, 2, 1, 8, 2, torch.float32, "cpu")
    k = torch.arange(2 * 3 * 2, dtype=torch.float32).view(2, 1, 3, 2)
    c.write(0, k, -k, torch.tensor([[0, 1, 2], [4, 5, 6]]))
    assert torch.equal(c.k[0, 0, 0, :3], k[0, 0]) and torch.equal(c.v[0, 1, 0, 4:7], -k[1, 0])
    c.reset(torch.tensor([3, 7]))
    c.crop(torch.tensor([1, 9]))  # never grows a row
    assert c.lengths.tolist() == [1, 7]
    c.commit(torch.tensor([2, 0]))
    assert c.lengths.tolist() == [3, 7]
    m = plan("sdpa", torch.tensor([[2], [5]]) + 1, c.slots, 1).mask  # causal: positions + 1
    assert m[0, 0, 0].tolist() == [True] * 3 + [False] * 5 and m[1, 0, 0, :6].all()


def _storages(module) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in module.parameters()}


def test_runtime_holds_one_copy_of_the_weights(pair):
    """The decoder's weights are the modules' own memory: every fused matrix (QKV, gate/up,
    q/k norm table) and every other tensor lies in a storage of the HF target's / drafter's
    parameters, the q/k/v and gate/up parameters are views of the fused matrices, and a second
    decoder over the same modules allocates no new weights."""
    target, drafter = pair
    dec = build_decoder(target, drafter, batch=1, max_len=16, graphs=False)
    tw, dw = dec.target, dec.drafter
    held = [tw.embed, tw.lm_head, tw.norm, dw.fc, dw.hidden_norm, dw.norm]
    for lw in tw.layers + dw.layers:
        held += [lw.ln1, lw.ln2, lw.wqkv, lw.wo, lw.qk_norm, lw.w_gate_up, lw.w_down]
    module_storages = _storages(target) | _storages(drafter)
    assert {t.untyped_storage().data_ptr() for t in held} <= module_storages
    for m, lw in zip(list(target.model.layers) + list(drafter.layers), tw.layers + dw.layers):
        a, size = m.self_attn, lw.wqkv.element_size()
        assert a.q_proj.weight.data_ptr() == lw.wqkv.data_ptr()
        assert a.k_proj.weight.data_ptr() == lw.wqkv.data_ptr() + a.q_proj.weight.numel() * size
        assert m.mlp.up_proj.weight.data_ptr() == (lw.w_gate_up.data_ptr()
                                                   + m.mlp.gate_proj.weight.numel() * size)
    again = build_decoder(target, drafter, batch=1, max_len=16, graphs=False)
    assert [lw.wqkv.data_ptr() for lw in again.target.layers] == [
        lw.wqkv.data_ptr() for lw in tw.layers]
    assert _storages(target) | _storages(drafter) == module_storages  # nothing re-fused


def test_forward_matches_hf_across_ragged_prefill_append_and_crop(pair):
    """Logits and features of the static-cache forward equal HF's on the committed sequence
    after: ragged prefill, a verify block, a crop (partial commit), and the next block."""
    target, drafter = pair
    layer_ids = drafter.config.target_layer_ids
    dec = build_decoder(target, drafter, batch=2, max_len=40, graphs=False)
    prompts = [[5, 17, 29, 41, 7], [9, 8]]
    ids = torch.tensor([prompts[0], prompts[1] + [0, 0, 0]])
    pos = torch.arange(5)[None].expand(2, 5)
    hn, _ = target_forward(dec.target, dec.tcache, dec.trope, ids, pos, pos + 1, layer_ids)
    dec.tcache.reset(torch.tensor([5, 2]))
    seqs = [list(p) for p in prompts]
    gen = torch.Generator().manual_seed(0)
    for keep in ([2, 4], [3, 1]):  # tokens committed of each 4-token block
        block = torch.randint(4, 97, (2, 4), generator=gen)
        pos = dec.tcache.lengths[:, None] + torch.arange(4)
        hn, feats = target_forward(dec.target, dec.tcache, dec.trope, block, pos, pos + 1,
                                   layer_ids)
        logits = torch.nn.functional.linear(hn, dec.target.lm_head)
        for r in range(2):
            full = torch.tensor([seqs[r] + block[r].tolist()])
            out = target(input_ids=full, output_hidden_states=True)
            ref_feats = context_features(out.hidden_states, layer_ids)
            torch.testing.assert_close(logits[r], out.logits[0, -4:], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(feats[r], ref_feats[0, -4:], rtol=1e-4, atol=1e-4)
            seqs[r] += block[r, :keep[r]].tolist()
        dec.tcache.commit(torch.tensor(keep))  # the rest of each block is cropped


def test_draft_block_matches_reference_drafter(pair):
    target, drafter = pair
    dec = build_decoder(target, drafter, batch=2, max_len=40, graphs=False)
    gen = torch.Generator().manual_seed(1)
    ctx = torch.randn(2, 9, drafter.config.num_context_features, generator=gen)
    pos = torch.arange(9)[None].expand(2, 9)
    context_write(dec.drafter, dec.dcache, dec.drope, ctx, pos)
    dec.tcache.reset(torch.tensor([9, 6]))  # row 1: slots 6..8 are stale and must be ignored
    anchor = torch.tensor([7, 11])
    ids = draft_block(dec.drafter, dec.dcache, dec.drope, dec.target.embed, dec.target.lm_head,
                      anchor, 8)
    for r, n in enumerate([9, 6]):
        block = torch.tensor([[anchor[r].item()] + [3] * 7])
        h = drafter(target.get_input_embeddings()(block), n + torch.arange(8)[None],
                    ctx[r:r + 1, :n], pos[r:r + 1, :n], None, None)
        assert ids[r].tolist() == target.lm_head(h[0, 1:]).argmax(-1).tolist()


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("block_size", [8, 16])
def test_dflash_token_identical_to_reference_and_greedy(pair, batch, block_size):
    target, drafter = pair
    prompts = PROMPTS[:batch]
    ref = speculative_generate(target, DFlashProposer(drafter), prompts, block_size=block_size,
                               max_new_tokens=40, fast=False)
    dec = build_decoder(target, drafter, batch=batch, max_len=64, graphs=False)
    res = fast_generate(dec, prompts, block_size=block_size, max_new_tokens=40)
    assert res.tokens == ref.tokens == greedy_reference(target, prompts, 40)
    assert [r.round_tokens for r in res.metrics.requests] == [
        r.round_tokens for r in ref.metrics.requests]
    assert max(res.metrics.requests[0].round_tokens) > 2  # multi-token commits exercised


def test_stop_tokens_padding_rows_and_reuse(pair):
    """A stop token ends a row mid-block; fewer prompts than batch rows; the decoder is reused."""
    target, drafter = pair
    greedy = greedy_reference(target, PROMPTS[:3], 30)
    stop = greedy[0][9]
    dec = build_decoder(target, drafter, batch=4, max_len=64, graphs=False)
    # captured CUDA graphs keep tensor addresses: state must never be reallocated
    addresses = [t.data_ptr() for t in dec._state() + [dec.draft_ids, dec.target_ids]]
    for _ in range(2):
        ref = speculative_generate(target, DFlashProposer(drafter), PROMPTS[:3], block_size=8,
                                   max_new_tokens=30, stop_token_ids=(stop,), fast=False)
        res = fast_generate(dec, PROMPTS[:3], block_size=8, max_new_tokens=30,
                            stop_token_ids=(stop,))
        assert res.tokens == ref.tokens
        assert res.tokens[0][-1] == stop and res.metrics.requests[0].stop_reason == "stop"
        assert [r.round_tokens for r in res.metrics.requests] == [
            r.round_tokens for r in ref.metrics.requests]
        assert [t.data_ptr() for t in dec._state() + [dec.draft_ids, dec.target_ids]] == addresses


@pytest.mark.parametrize("block_size", [1, 8])
def test_fused_round_equals_reference(pair, block_size):
    """One step function per round (draft + verify + accept; one CUDA graph on GPUs): same
    tokens and per-round commits as the reference loop, with a stop token and a padding row."""
    target, drafter = pair
    stop = greedy_reference(target, PROMPTS[:1], 30)[0][9]
    proposer = DFlashProposer(drafter) if block_size > 1 else None
    dec = build_decoder(target, drafter, batch=4, max_len=64, graphs=False, fuse_round=True)
    res = fast_generate(dec, PROMPTS[:3], block_size=block_size, max_new_tokens=30,
                        stop_token_ids=(stop,), proposer="dflash" if proposer else "ar")
    if proposer is None:
        assert res.tokens == greedy_reference(target, PROMPTS[:3], 30, eos_token_id=stop)
        return
    ref = speculative_generate(target, proposer, PROMPTS[:3], block_size=block_size,
                               max_new_tokens=30, stop_token_ids=(stop,), fast=False)
    assert res.tokens == ref.tokens and res.tokens[0][-1] == stop
    assert [r.round_tokens for r in res.metrics.requests] == [
        r.round_tokens for r in ref.metrics.requests]


def test_ngram_and_plain_ar(pair):
    target, _ = pair
    prompts = [p * 3 for p in PROMPTS]  # repeats give prompt lookup something to find
    greedy = greedy_reference(target, prompts, 32)
    dec = build_decoder(target, None, batch=4, max_len=96, graphs=False)
    ar = fast_generate(dec, prompts, block_size=1, max_new_tokens=32, proposer="ar")
    assert ar.tokens == greedy and ar.metrics.tau == 1.0
    ng = fast_generate(dec, prompts, block_size=8, max_new_tokens=32, proposer="ngram")
    ref = speculative_generate(target, NgramProposer(), prompts, block_size=8, max_new_tokens=32)
    assert ng.tokens == greedy
    assert [r.round_tokens for r in ng.metrics.requests] == [
        r.round_tokens for r in ref.metrics.requests]


def _accept_state(seed, b=5, q=8, slots=40):
    g = torch.Generator().manual_seed(seed)
    tgt = torch.randint(0, 4, (b, q), generator=g)
    drf = torch.randint(0, 4, (b, q - 1), generator=g)
    drf[0] = tgt[0, :-1]  # row 0 accepts the whole block
    z = dict(dtype=torch.long)
    return [tgt, drf, torch.tensor([3, -1, -1]), torch.tensor(20),
            torch.zeros(b, slots + 1, **z), torch.randint(1, 18, (b,), generator=g),
            torch.zeros(b, **z), torch.randint(5, 9, (b,), generator=g),
            torch.tensor([False, False, True, False, False]), torch.zeros(12, 3, b, **z),
            torch.tensor([4])]


def test_compiled_accept_equals_eager():
    """`compile_steps` swaps in a torch.compile'd acceptance step: its in-place updates of the
    decoder state (output buffer, lengths, anchor, done, history) must equal the eager ones,
    including stop tokens (3), max_new caps (20), finished rows and full accepts."""
    compiled = torch.compile(accept_round, dynamic=True)
    for seed in range(3):
        eager, comp = _accept_state(seed), _accept_state(seed)
        accept_round(*eager)
        compiled(*comp)
        for name, a, b in zip(["tgt", "drf", "stops", "max_new", "out_buf", "out_len", "anchor",
                               "lengths", "done", "history", "round_idx"], eager, comp):
            assert torch.equal(a, b), (seed, name)
        assert not torch.equal(eager[5], _accept_state(seed)[5])  # the step changed the state


def test_unsupported_and_bad_input(pair, llama_target):
    target, drafter = pair
    assert supports(target) and not supports(llama_target)
    with pytest.raises(ConfigError, match="fast"):
        speculative_generate(llama_target, DFlashProposer(drafter), [[5, 6]], block_size=8,
                             max_new_tokens=4, fast=True)
    dec = build_decoder(target, drafter, batch=1, max_len=16, graphs=False)
    with pytest.raises(ConfigError, match="max_new_tokens"):
        fast_generate(dec, [[5, 6, 7]], block_size=8, max_new_tokens=60)
    with pytest.raises(ConfigError, match="attention.*one of"):
        build_decoder(target, drafter, batch=1, max_len=16, attention="flash")


def test_triton_attention_needs_cuda_or_the_interpreter(pair, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="attention: 'triton' needs a CUDA device"):
        build_decoder(pair[0], None, batch=1, max_len=16, attention="triton")
    # "auto" (the default) picks SDPA off CUDA and passes explicit names through
    assert build_decoder(pair[0], None, batch=1, max_len=16, graphs=False).attention == "sdpa"
    assert resolve_backend("auto", torch.device("cpu")) == "sdpa"
    assert resolve_backend("triton", torch.device("cpu")) == "triton"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("attention", ["sdpa", "triton"])
def test_cuda_graphs_match_eager_and_cpu(pair, attention):
    target, drafter = pair
    expected = greedy_reference(target, PROMPTS, 40)
    tgt, drf = tiny_target().cuda(), drafter.to("cuda")
    try:
        for graphs in (False, True, "compiled", "fused"):
            compile_steps(graphs == "compiled")
            dec = build_decoder(tgt, drf, batch=4, max_len=64, graphs=bool(graphs),
                                attention=attention, fuse_round=graphs == "fused")
            res = fast_generate(dec, PROMPTS, block_size=8, max_new_tokens=40, profile=True)
            assert res.tokens == expected
            res = fast_generate(dec, PROMPTS, block_size=8, max_new_tokens=40)  # replays
            assert res.tokens == expected
        auto = speculative_generate(tgt, DFlashProposer(drf), PROMPTS, block_size=8,
                                    max_new_tokens=40)  # CUDA: the fast path by default
        assert auto.tokens == expected
        plain = build_decoder(tgt, None, batch=4, max_len=64, attention=attention)
        for proposer in ("ar", "ngram"):
            res = fast_generate(plain, PROMPTS, block_size=8, max_new_tokens=40,
                                proposer=proposer)
            assert res.tokens == expected
    finally:
        compile_steps(False)
        drafter.to("cpu")
