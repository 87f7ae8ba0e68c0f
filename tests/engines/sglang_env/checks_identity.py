"""Spiffy's draft rows inside SGLang's dLLM loops, against our reference runtime.

Real: SGLang's `DllmAlgorithm.run` loops (sync and FDFO), its `ForwardBatch`, `ReqToTokenPool`
and paged KV allocator, the Spiffy algorithm class built from command-line strings, the converted
SDAR checkpoint. Mocked (SGLang has no CPU model forward outside its server): `SlotRunner`, whose
"KV pool" stores the token id written to each slot and whose forward scores every sequence of the
batch from the tokens its req_to_token row reads (full recompute with our model); `serve` stands
in for the scheduler. So a draft row that read the wrong prefix slots, overwrote its root's block
slots, or a wrong final-canvas K/V copy would change the output.
"""

import json
from types import SimpleNamespace

import pytest
import torch

from tests.engines.sglang_env import shims

shims.install()

from sglang.srt.dllm.algorithm import get_algorithm  # noqa: E402
from sglang.srt.dllm.config import DllmConfig  # noqa: E402
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402

from spiffy_plugin.decode import generate  # noqa: E402
from spiffy_plugin.engines.sglang_batch import DraftRows, extend_batch, unsupported  # noqa: E402
from spiffy_plugin.params import DecodeParams  # noqa: E402
from tests.engines.sglang_env.fixtures import FIX, server_args  # noqa: E402


class SlotTokens:
    """Mock KV pool: the token id held by each slot; copies like SGLang's `move_kv_cache`."""
    _kv_copy_config = {}

    def __init__(self, size: int):
        self.tokens = torch.full((size,), -1, dtype=torch.long)

    def move_kv_cache(self, tgt, src):
        self.tokens[tgt.long()] = self.tokens[src.long()]


class SlotRunner:
    """Mock ModelRunner over real SGLang pools (see the module docstring)."""

    def __init__(self, model, bs: int, slots: int = 4096, rows: int = 32):
        self.model, self.bs = model, bs
        self.req_to_token_pool = ReqToTokenPool(rows, 1024, "cpu", False)
        self.token_to_kv_pool_allocator = PagedTokenToKVPoolAllocator(
            slots, bs, torch.float32, "cpu", None, False)
        self.token_to_kv_pool = SlotTokens(slots + bs)
        self.max_running_requests = rows
        self.forwards, self.rows_per_forward = 0, []

    def forward(self, fb, pp_proxy_tensors=None):
        kv, table, bs = self.token_to_kv_pool, self.req_to_token_pool.req_to_token, self.bs
        kv.tokens[fb.out_cache_loc.long()] = fb.input_ids  # "write K/V" of every row
        ctx = [kv.tokens[table[int(fb.req_pool_indices[r]), : int(fb.seq_lens[r])].long()]
               for r in range(fb.batch_size)]
        assert all((c >= 0).all() for c in ctx), "a sequence read a slot nobody wrote"
        out = torch.empty(fb.batch_size, bs, self.model.config.vocab_size)
        for n in {len(c) for c in ctx}:  # sequences of one length in one call
            rows = [r for r, c in enumerate(ctx) if len(c) == n]
            blk = torch.arange(n) // bs
            mask = torch.zeros(n, n).masked_fill(blk[None] > blk[:, None], -1e30)
            out[rows] = self.model(input_ids=torch.stack([ctx[r] for r in rows]),
                                   attention_mask=mask[None, None]).logits[:, -bs:]
        self.forwards += 1
        self.rows_per_forward.append(fb.batch_size)
        logits = out.view(-1, out.shape[-1])
        return SimpleNamespace(logits_output=SimpleNamespace(full_logits=logits),
                               can_run_graph=False)


def forward_batch(reqs, bs: int) -> ForwardBatch:
    """What `ForwardBatch.init_new` builds for a DLLM_EXTEND batch, one block per request."""
    pre = [r["prefix"] for r in reqs]
    slots = [r["slots"] for r in reqs]
    return ForwardBatch(
        forward_mode=ForwardMode.DLLM_EXTEND, batch_size=len(reqs),
        input_ids=torch.cat([r["canvas"] for r in reqs]),
        req_pool_indices=torch.tensor([r["row"] for r in reqs]),
        seq_lens=torch.tensor([p + bs for p in pre]),
        seq_lens_cpu=torch.tensor([p + bs for p in pre]),
        out_cache_loc=torch.cat(slots), seq_lens_sum=sum(pre) + bs * len(reqs),
        positions=torch.cat([torch.arange(p, p + bs) for p in pre]),
        extend_seq_lens=torch.tensor([bs] * len(reqs)), extend_prefix_lens=torch.tensor(pre),
        extend_seq_lens_cpu=[bs] * len(reqs), extend_prefix_lens_cpu=pre,
        extend_num_tokens=bs * len(reqs), extend_start_loc=torch.arange(len(reqs)) * bs,
        dllm_prompt_mask=torch.stack([r["prompt_mask"] for r in reqs]),
        rids=[r["rid"] for r in reqs])


def serve(algo, mr, prompts, max_new_tokens: int, fdfo: bool) -> list[list[int]]:
    """The scheduler's part: per request a req_to_token row, committed prompt blocks, one block
    canvas at a time (prompt tail + masks); FDFO re-batches after every forward."""
    bs, mask, eos = algo.block_size, algo.mask_id, algo.cfg.eos_token_id
    alloc, pool = mr.token_to_kv_pool_allocator, mr.req_to_token_pool
    table, free0, rows0 = pool.req_to_token, alloc.available_size(), pool.available_size()
    reqs = []
    for k, p in enumerate(prompts):
        row, start = pool.alloc_rows(1)[0], len(p) // bs * bs
        if start:
            slots = alloc.alloc(start)
            table[row, :start] = slots.to(table.dtype)
            mr.token_to_kv_pool.tokens[slots] = torch.tensor(p[:start])
        reqs.append(dict(rid=f"r{k}", row=row, prefix=start, tail=p[start:], out=[],
                         state=None, canvas=None))

    def open_block(r):
        r["slots"] = alloc.alloc(bs)
        table[r["row"], r["prefix"]: r["prefix"] + bs] = r["slots"].to(table.dtype)
        r["canvas"] = torch.tensor(r["tail"] + [mask] * (bs - len(r["tail"])))
        r["prompt_mask"] = torch.arange(bs) < len(r["tail"])

    def close_block(r, canvas):  # SGLang keeps the block's K/V: they must be its final canvas's
        assert mr.token_to_kv_pool.tokens[r["slots"]].tolist() == list(canvas), "stale block K/V"
        r["out"] += canvas[len(r["tail"]):]
        r["prefix"], r["tail"], r["canvas"], r["state"] = r["prefix"] + bs, [], None, None

    def live():
        return [r for r in reqs if len(r["out"]) < max_new_tokens and eos not in r["out"]]

    while live():
        batch = live()
        for r in batch:
            if r["canvas"] is None:
                open_block(r)
        fb = forward_batch(batch, bs)
        if fdfo:
            _, ids, accepted, states, _ = algo.run(mr, fb, [r["state"] for r in batch])
            for r, c, a, s in zip(batch, ids, accepted, states):
                if a:
                    close_block(r, c)
                else:
                    r["canvas"], r["state"] = torch.tensor(c), s
        else:
            algo.run(mr, fb)
            for i, r in enumerate(batch):
                close_block(r, fb.input_ids.view(-1, bs)[i].tolist())
    for r in reqs:
        alloc.free(table[r["row"], : r["prefix"]].long())
        pool.free_rows([r["row"]])
    assert (alloc.available_size(), pool.available_size()) == (free0, rows0), "slots leaked"
    return [r["out"][: r["out"].index(eos) + 1] if eos in r["out"] else r["out"] for r in reqs]


@pytest.fixture(scope="module")
def model(sdar_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(sdar_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("fdfo,copy_kv", [(False, "1"), (True, "1"), (True, "0")])
def test_sglang_loops_with_spiffy_drafts_match_reference(sdar_dir, graph_path, tmp_path, model,
                                                         fdfo, copy_kv, monkeypatch):
    """copy_kv "0": SPIFFY_COPY_DRAFT_KV=0, a verified block's K/V written by a forward of its
    own instead of copied from the draft row (close_block checks them either way)."""
    from transformers import AutoTokenizer

    from dflash_plugin.training.data import load_prompts_jsonl

    monkeypatch.setenv("SPIFFY_COPY_DRAFT_KV", copy_kv)
    config = DllmConfig.from_server_args(server_args(sdar_dir, "Spiffy", {"graph": graph_path},
                                                     tmp_path))
    config.first_done_first_out_mode = fdfo
    algo = get_algorithm(config)
    tok = AutoTokenizer.from_pretrained(sdar_dir)
    prompts = [tok(t).input_ids[-40:] for t in load_prompts_jsonl(FIX / "dev-prompts.jsonl")[:2]]
    prompts[1] = prompts[1][:32]  # one prompt ends on a block boundary
    n = 24  # SGLang fills whole blocks: the reference stops on the same block boundary
    refs = [generate(model, p, DecodeParams(unmask_per_step=1), 32 - len(p) % 16).tokens
            for p in prompts]
    mr = SlotRunner(model, algo.block_size)
    with torch.inference_mode():
        got = serve(algo, mr, prompts, n, fdfo)
    for p, ref, g in zip(prompts, refs, got):
        assert len(g) >= len(ref) and g[: len(ref)] == ref, json.dumps(
            {"prompt": p, "ref": ref, "sglang": g})
    assert sum(map(len, refs)) >= 50
    assert max(mr.rows_per_forward) > len(prompts)  # draft rows joined the forwards
    steps, blocks = algo.totals["steps"], algo.totals["blocks"]
    assert algo.totals["accepted"] > 0
    # one-step decoding: one forward per step + one that persists each block's final canvas
    assert mr.forwards < steps + blocks, (mr.forwards, steps, blocks)


def test_drafts_that_do_not_fit_are_skipped_exactly(sdar_dir, graph_path, tmp_path, model):
    """With no room for draft rows SGLang's loop runs one step per forward: steps + 1 forwards
    per block (the one-step baseline the serve test derives); with room for one, fewer."""
    config = DllmConfig.from_server_args(server_args(sdar_dir, "Spiffy", {"graph": graph_path},
                                                     tmp_path))
    algo = get_algorithm(config)
    prompt = [5, 17, 29, 41, 53]
    ref = generate(model, prompt, DecodeParams(unmask_per_step=1), 27).tokens
    forwards = []
    for rows in (1, 2):  # the request's own row, plus room for 0 / 1 draft rows
        mr = SlotRunner(model, algo.block_size, rows=rows)
        steps, blocks = algo.totals["steps"], algo.totals["blocks"]
        with torch.inference_mode():
            assert serve(algo, mr, [prompt], 27, fdfo=True)[0][: len(ref)] == ref
        assert max(mr.rows_per_forward) == rows
        forwards.append((mr.forwards, algo.totals["steps"] - steps,
                         algo.totals["blocks"] - blocks))
    (plain, steps, blocks), (one_draft, *_) = forwards
    assert plain == steps + blocks and one_draft < plain, forwards


def test_draft_rows_share_the_prefix_slots_and_are_freed(model):
    bs, mr = 16, SlotRunner(model, 16, slots=1024, rows=8)
    alloc, pool = mr.token_to_kv_pool_allocator, mr.req_to_token_pool
    free0, rows0 = alloc.available_size(), pool.available_size()
    table, reqs = pool.req_to_token, []
    for k, prefix in enumerate((32, 16)):
        row, slots = pool.alloc_rows(1)[0], alloc.alloc(prefix + bs)
        table[row, : prefix + bs] = slots.to(table.dtype)
        reqs.append(dict(rid=f"r{k}", row=row, prefix=prefix, slots=slots[prefix:],
                         canvas=torch.full((bs,), 2),
                         prompt_mask=torch.zeros(bs, dtype=torch.bool)))
    fb = forward_batch(reqs, bs)
    assert unsupported(fb, bs, 16) is None
    rows = DraftRows(mr)
    assert rows.budget(2, bs) == 6 and rows.allocate(3, bs)
    drafts = torch.arange(3 * bs).view(3, bs)
    out = extend_batch(fb, [1, 1, 0], drafts, rows, bs)
    assert out.batch_size == 5 and out.input_ids.shape == (5 * bs,)
    assert torch.equal(out.input_ids[: 2 * bs], fb.input_ids)  # the roots first, unchanged
    assert torch.equal(out.input_ids[2 * bs:], drafts.view(-1))
    assert out.req_pool_indices.tolist() == [reqs[0]["row"], reqs[1]["row"]] + rows.rows
    assert out.seq_lens.tolist() == [48, 32, 32, 32, 48] and out.seq_lens_sum == 192
    assert out.extend_prefix_lens_cpu == [32, 16, 16, 16, 32] and out.rids[2:] == ["r1", "r1", "r0"]
    assert torch.equal(out.positions.view(5, bs)[2:], fb.positions.view(2, bs)[[1, 1, 0]])
    for r, owner in enumerate([1, 1, 0]):
        root, p = reqs[owner]["row"], reqs[owner]["prefix"]
        assert torch.equal(table[rows.rows[r], :p], table[root, :p])  # shared prefix slots
        own = table[rows.rows[r], p: p + bs].long()
        assert torch.equal(own, rows.block_slots(r, bs)) and torch.equal(
            out.out_cache_loc.view(5, bs)[2 + r], own)
        assert not set(own.tolist()) & set(table[root, : p + bs].tolist())  # fresh block slots
    rows.release()
    for r in reqs:
        alloc.free(table[r["row"], : r["prefix"] + bs].long())
    pool.free_rows([r["row"] for r in reqs])
    assert (alloc.available_size(), pool.available_size()) == (free0, rows0)
    fb.return_logprob = True
    assert unsupported(fb, bs, 16) == "logprobs requested"
    fb.return_logprob = False
    assert "page size" in unsupported(fb, bs, 32)
