"""Tensor parallelism (`--tp-size 2`) against real SGLang, CPU only (issue 22's CPU part): run by
`test_sglang.py` in the 0.5.23 env (fixtures plugin) and by `test_tp.py` in the 0.5.16 env
(legacy plugin), one subprocess each.

Server args are SGLang's own `prepare_server_args` from command-line strings with `--tp-size 2`:
Spiffy / SpecFold resolve and validate as with TP = 1, and so does DFLASH_TREE, whose ranks read
the whole LM head reassembled from SGLang's own shards. Per-rank pieces: under TP every rank's
scheduler builds its own algorithm from the same server args and drives its own model runner,
whose `ReqToTokenPool` and KV allocator hold that rank's rows and slots. Two "ranks" (two
algorithm instances, two mock runners of `checks_identity.py` over real SGLang pools) must take
the same decisions (equal forwards and batch shapes: the sequences of one forward are a
collective's shape), allocate only from their own pools, free every draft row and slot there,
and never touch the other rank's.
"""

import json

import pytest
import torch

from tests.engines.sglang_env import shims

shims.install()

from sglang.srt.dllm.config import DllmConfig  # noqa: E402

from dflash_plugin.errors import ConfigError as DFlashConfigError  # noqa: E402
from spiffy_plugin.engines.versions import installed  # noqa: E402
from tests.engines.sglang_env.fixtures import FIX  # noqa: E402

OLD = installed("sglang") < (0, 5, 21)  # get_algorithm(config) only; no configure_server_args
TP = 2


def _resolved(sa):
    if hasattr(sa, "resolve_once"):  # 0.5.23 resolves on `resolve_once`, 0.5.16 in __post_init__
        sa.resolve_once()
    return sa


def tp_server_args(model, algorithm, config, tmp_path, tp=TP):
    """`fixtures.server_args` plus `--tp-size`."""
    from sglang.srt.server_args import prepare_server_args

    argv = ["--model-path", str(model), "--device", "cpu", "--dllm-algorithm", algorithm,
            "--tp-size", str(tp)]
    if config is not None:
        path = tmp_path / f"{algorithm}-tp{tp}.yaml"
        path.write_text(json.dumps(config))
        argv += ["--dllm-algorithm-config", str(path)]
    return _resolved(prepare_server_args(argv))


def build(config: DllmConfig):
    if OLD:
        from sglang.srt.dllm.algorithm import get_algorithm

        return get_algorithm(config)
    from sglang.srt.dllm.algorithm import get_algorithm_cls

    return get_algorithm_cls(config.algorithm)(config)


def _fields(cfg: DllmConfig) -> dict:
    return {k: getattr(cfg, k) for k in ("algorithm", "mask_id", "block_size",
                                         "max_running_requests", "algorithm_config")}


@pytest.mark.parametrize("algorithm,extra", [("Spiffy", {"keep": 2}),
                                             ("SpecFold", {"delta": 0.25})])
def test_tp2_server_args_resolve_as_tp1(sdar_dir, graph_path, tmp_path, algorithm, extra):
    config = {"graph": graph_path, **extra}
    sa = tp_server_args(sdar_dir, algorithm, config, tmp_path)
    assert sa.tp_size == TP
    one = DllmConfig.from_server_args(tp_server_args(sdar_dir, algorithm, config, tmp_path, 1))
    two = DllmConfig.from_server_args(sa)
    assert _fields(two) == _fields(one)
    assert (two.mask_id, two.block_size) == (2, 16)  # the checkpoint's, on every rank
    if not OLD:
        from sglang.srt.dllm.algorithm import get_algorithm_cls

        get_algorithm_cls(algorithm).configure_server_args(sa)  # launch-time check passes
    algo = build(two)
    assert type(algo).__name__ == algorithm and algo.cfg.keep == extra.get("keep", 3)


@pytest.mark.parametrize("algorithm", ["Spiffy", "SpecFold"])
def test_tp2_bad_config_still_fails_with_a_clear_message(sdar_dir, graph_path, tmp_path,
                                                         algorithm):
    from spiffy_plugin.errors import ConfigError

    with pytest.raises(ConfigError, match=r"keep: must be an integer \[1, 3\], got 4"):
        sa = tp_server_args(sdar_dir, algorithm, {"graph": graph_path, "keep": 4}, tmp_path)
        if not OLD:
            from sglang.srt.dllm.algorithm import get_algorithm_cls

            get_algorithm_cls(algorithm).configure_server_args(sa)


def test_dflash_tree_accepts_tp2():
    """DFLASH_TREE resolves under `--tp-size 2` through SGLang's own argument resolution (every
    rank reads the whole LM head: sglang_tree_tp); what is still refused here is the CPU device
    (0.5.16) or the SGLang version of the worker (0.5.23), never `tp_size`."""
    from sglang.srt.server_args import prepare_server_args

    from dflash_plugin.engines.sglang import register

    register()
    with pytest.raises(DFlashConfigError, match=r"^(device|sglang): ") as err:
        _resolved(prepare_server_args([
            "--model-path", str(FIX / "code-target"), "--speculative-algorithm", "DFLASH_TREE",
            "--speculative-draft-model-path", str(FIX / "code-target-dflash-b16"),
            "--speculative-num-draft-tokens", "17", "--device", "cpu", "--tp-size", "2"]))
    assert "tp_size" not in str(err.value)


@pytest.mark.parametrize("vocab,tp", [(100, 2), (1000, 4), (151_936, 2)])
def test_dflash_tree_reassembles_sglang_lm_head_shards(vocab, tp):
    """SGLang's own `ParallelLMHead` built as each of `tp` ranks (padded shards, real rows first)
    gives back, through `replicated_head`, the unsharded head on every rank. The group is
    `FakeTPGroup` (test_sglang_tree_tp.py), as no multi-rank NCCL group runs on CPU."""
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead
    from sglang.srt.runtime_context import get_parallel

    from dflash_plugin.engines.sglang_tree_tp import replicated_head
    from tests.engines.test_sglang_tree_tp import FakeTPGroup

    full = torch.randn(vocab, 8, generator=torch.Generator().manual_seed(vocab))
    heads = []
    for rank in range(tp):
        with get_parallel().override(tp_rank=rank, tp_size=tp):
            head = ParallelLMHead(vocab, 8, params_dtype=torch.float32)
        shard = head.shard_indices
        start, count = int(shard.org_vocab_start_index), int(shard.num_org_elements)
        with torch.no_grad():
            head.weight.fill_(50.0)  # padding rows: must never reach the whole head
            head.weight[:count] = full[start:start + count]
        heads.append(head)
    for rank in range(tp):
        got = replicated_head(heads[rank], FakeTPGroup(heads))
        assert torch.equal(got.weight, full)


# --- per-rank state ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model(sdar_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(sdar_dir, dtype=torch.float32).eval()


@pytest.fixture
def identity(monkeypatch):
    """`checks_identity` (SlotRunner, serve), on SGLang 0.5.16 with the legacy pool and batch."""
    from tests.engines.sglang_env import checks_identity as ci

    if OLD:
        from tests.engines.sglang_env import legacy_checks as lc

        monkeypatch.setattr(ci, "ReqToTokenPool", lc._Pool.wrap(ci.ReqToTokenPool))
        monkeypatch.setattr(ci, "ForwardBatch", lc._legacy_batch)
    return ci


def _pool_state(mr) -> tuple:
    alloc, pool = mr.token_to_kv_pool_allocator, mr.req_to_token_pool
    free = getattr(alloc, "free_pages", None)
    rows = getattr(pool, "free_slots", None)
    return (alloc.available_size(), pool.available_size(),
            None if free is None else sorted(free.tolist()),
            None if rows is None else sorted(rows))


@pytest.mark.parametrize("algorithm,fdfo", [("Spiffy", False), ("SpecFold", True)])
def test_each_rank_runs_its_own_algorithm_over_its_own_pools(sdar_dir, graph_path, tmp_path,
                                                             model, identity, algorithm, fdfo):
    ci = identity
    prompts = [[5, 17, 29, 41, 53], list(range(40, 72))]  # one ends on a block boundary
    ranks = []
    for _ in range(TP):  # each rank's scheduler: its own config, algorithm and model runner
        config = DllmConfig.from_server_args(
            tp_server_args(sdar_dir, algorithm, {"graph": graph_path}, tmp_path))
        config.first_done_first_out_mode = fdfo
        ranks.append(build(config))
    assert ranks[0] is not ranks[1]
    runs = []
    for r, algo in enumerate(ranks):
        mr = ci.SlotRunner(model, algo.block_size, slots=2048, rows=12)
        before = _pool_state(mr)
        others = [(m, _pool_state(m)) for m, _, _ in runs]
        with torch.inference_mode():
            out = ci.serve(algo, mr, prompts, 20, fdfo)  # asserts: no slot / row leaked
        assert _pool_state(mr) == before, f"rank {r}: pool state differs after serving"
        for m, state in others:
            assert _pool_state(m) == state, f"rank {r} touched another rank's pools"
        assert algo._scorer.mr is mr and algo._scorer.rows.mr is mr
        assert not algo._scorer.rows.rows and algo._scorer.rows.slots is None  # released
        runs.append((mr, algo, out))
    (m0, a0, out0), (m1, a1, out1) = runs
    assert out0 == out1
    assert m0.forwards == m1.forwards and m0.rows_per_forward == m1.rows_per_forward
    assert max(m0.rows_per_forward) > len(prompts)  # draft rows joined the forwards
    assert a0.totals == a1.totals and a0.totals["accepted"] > 0


def test_sampled_streams_are_the_same_on_every_rank(sdar_dir, graph_path, tmp_path):
    """A sampled request's random stream comes from its rid (or its own seed), never from state
    of one rank: two ranks' algorithms draw the same numbers (token choices stay in lock-step)."""
    draws = []
    for _ in range(TP):
        algo = build(DllmConfig.from_server_args(
            tp_server_args(sdar_dir, "Spiffy", {"graph": graph_path, "seed": 7}, tmp_path)))
        got = []
        for rid, seed, start in (("a", None, 0), ("b", 123, 16), ("a", None, 16)):
            g = algo.streams.get(rid, torch.device("cpu"), seed, start)
            got.append(torch.rand(4, generator=g).tolist())
        algo.streams.drop("b")
        g = algo.streams.get("b", torch.device("cpu"), 123, 32)  # re-created: a new stream
        got.append(torch.rand(4, generator=g).tolist())
        draws.append(got)
    assert draws[0] == draws[1]
    assert draws[0][0] != draws[0][2] and draws[0][1] != draws[0][3]


def test_validate_request_runs_in_every_ranks_scheduler():
    """`Spiffy.validate_request` notes a request's `sampling_seed` in the process that runs it;
    SGLang calls it from `Scheduler.handle_generate_request`, which every TP rank runs for every
    request (rank 0 broadcasts the requests), not from the tokenizer or a rank-0 branch."""
    if OLD:
        pytest.skip("SGLang < 0.5.23 has no per-request dLLM validation")
    import inspect

    from sglang.srt.managers.scheduler import Scheduler

    src = inspect.getsource(Scheduler._handle_generate_request)
    assert "validate_dllm_request" in src
    assert "tp_rank == 0" not in src and "tp_rank != 0" not in src
    from sglang.srt.dllm.mixin.scheduler import SchedulerDllmMixin

    assert "validate_request" in inspect.getsource(SchedulerDllmMixin.validate_dllm_request)



def test_folded_layer_keeps_the_collectives_full_width():
    """SpecFold's folded SDAR layer runs qkv_proj / the FFN on a rank-local subset of rows, so
    under TP it relies on SGLang's SDAR layer deferring the o_proj / down_proj all-reduce to the
    layer boundary (`finish`, over every row of the batch, after the folded rows are expanded
    back): each collective then has the same shape on every rank whatever the gate picks."""
    if OLD:
        pytest.skip("SGLang < 0.5.21: no folded layer (SpecFold scores densely)")
    import inspect

    from sglang.srt.models.sdar import SDARBlock

    init = inspect.getsource(SDARBlock.__init__)
    assert init.count("reduce_results=False") == 2, "SDAR's attention / MLP reduce by themselves"
    src = inspect.getsource(SDARBlock.forward)
    assert "attn_boundary.finish" in src and "ffn_boundary.finish" in src
