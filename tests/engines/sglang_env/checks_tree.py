"""DFLASH_TREE against real SGLang: run by `test_sglang.py` in the 0.5.23 env (fixtures plugin)
and by `test_sglang_tree.py` in the 0.5.16 env (legacy plugin), one subprocess each.

Registration (idempotent, builtin names reserved, entry point), SGLang's conformance check of
our `CustomSpecAlgo`, launch-time validation through SGLang's own `prepare_server_args` on CPU,
and our tree-verify tensors walked by SGLang's own greedy tree-verify Triton kernel
(`verify_tree_greedy_kernel_triton`, run by Triton's interpreter: the CUDA / sgl_kernel ops do not
run here) against `tree.walk_tree`. Nothing of SGLang is mocked; 0.5.23's tree-link
reconstruction kernel needs a stub `sgl_kernel` module only to be importable. The worker's
conformance with SGLang 0.5.16's source: `checks_tree_worker.py`.
"""

import inspect
import sys
from importlib import metadata

import pytest
import torch

from tests.engines.sglang_env import shims

shims.install()

from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402
from sglang.srt.speculative.spec_registry import get_spec  # noqa: E402

from dflash_plugin.engines import sglang_tree_algo as algo  # noqa: E402
from dflash_plugin.engines.sglang import register  # noqa: E402
from dflash_plugin.engines.sglang_tree_input import build_verify_tensors  # noqa: E402
from dflash_plugin.errors import ConfigError  # noqa: E402
from dflash_plugin.fast.tree_build import build_tree  # noqa: E402
from dflash_plugin.tree import Tree, walk_tree  # noqa: E402
from spiffy_plugin.engines.versions import installed  # noqa: E402
from tests.engines.sglang_env.fixtures import FIX  # noqa: E402

OLD = installed("sglang") <= (0, 5, 16)
TARGET, DRAFT = FIX / "code-target", FIX / "code-target-dflash-b16"


def test_registration_is_idempotent_and_reserved():
    register()
    register()
    spec = SpeculativeAlgorithm.from_string("dflash_tree")
    assert spec is get_spec("DFLASH_TREE") and type(spec).__name__ == "DFlashTreeAlgo"
    assert spec.supports_overlap and spec.validate_server_args is algo.validate_server_args
    assert algo.register() is False  # already there: no second registration
    with pytest.raises(ValueError, match="reserved"):
        SpeculativeAlgorithm.register("DFLASH", spec_class=algo.spec_class())(lambda sa: None)
    from sglang.srt.plugins.hook_registry import HookRegistry

    from dflash_plugin.engines.sglang_tree_hooks import GET_SPEC_INFO, capture_spec_info

    assert [h for _, h, _ in HookRegistry._hooks[GET_SPEC_INFO]].count(capture_spec_info) == 1
    assert SpeculativeAlgorithm.from_string("DFLASH") is SpeculativeAlgorithm.DFLASH  # intact


def test_entry_point_loads_by_name(monkeypatch):
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group

    monkeypatch.setenv("SGLANG_PLUGINS", "dflash_plugin")
    found = load_plugins_by_group(GENERAL_PLUGINS_GROUP)
    assert sorted(found) == ["dflash_plugin"], found
    func, dist = found["dflash_plugin"]
    assert f"{func.__module__}:{func.__qualname__}" == "dflash_plugin.engines.sglang:register"
    assert dist.replace("_", "-") == "specdec-plugins"
    func()  # idempotent after the registrations above
    eps = {ep.name: ep.value for ep in metadata.entry_points(group=GENERAL_PLUGINS_GROUP)}
    assert eps["dflash_plugin"] == "dflash_plugin.engines.sglang:register"


def test_spec_class_conforms_and_answers_as_designed():
    from sglang.srt.speculative.spec_registry import _assert_custom_spec_algo_conforms

    cls = algo.spec_class()
    _assert_custom_spec_algo_conforms(cls)  # every is_* / supports_* of this SGLang's enum
    spec = get_spec("DFLASH_TREE") or cls("DFLASH_TREE", lambda sa: None)
    answers = {"is_dflash_family": True, "is_dflash": False, "is_eagle": False,
               "is_eagle3": False, "is_standalone": False, "is_ngram": False, "is_none": False,
               "is_some": True, "is_speculative": True, "supports_target_verify_for_draft": True,
               "has_draft_kv": False}
    assert {k: getattr(spec, k)() for k in answers} == answers
    # SGLang's conformance check covers is_* / supports_* only; the scheduler calls more of
    # the enum's methods on the algorithm object (0.5.16's start-up died on the first missing
    # one, `carries_draft_hidden_states`, on the H200): every instance method must answer
    methods = [n for n, v in vars(SpeculativeAlgorithm).items() if not n.startswith("_")
               and inspect.isfunction(v)]
    assert "carries_draft_hidden_states" in methods or not OLD, methods
    missing = [n for n in methods if not callable(getattr(spec, n, None))]
    if OLD:  # the worker's SGLang (newer ones refuse DFLASH_TREE at launch: LAST below;
        # 0.5.23's enum adds get_platform_worker_cls, which nothing of DFLASH_TREE's path calls)
        assert not missing, f"DFLASH_TREE's spec class lacks SpeculativeAlgorithm.{missing}"
        assert spec.carries_draft_hidden_states() is False
        assert spec.need_topk() is False
    if hasattr(spec, "supports_prefill_shared_read_done"):
        assert spec.supports_prefill_shared_read_done() is False
    # no server running here: both runners get the width they are asked for
    assert spec.get_num_tokens_per_req_for_target_verify(33, False) == 33
    assert spec.get_num_tokens_per_req_for_target_verify(16, True) == 16


def _server_args(*extra):
    from sglang.srt.server_args import prepare_server_args

    return _resolved(prepare_server_args([
        "--model-path", str(TARGET), "--speculative-algorithm", "DFLASH_TREE",
        "--speculative-draft-model-path", str(DRAFT), *extra]))


def _resolved(sa):
    """0.5.23 resolves server args on `resolve_once` (the launcher calls it); 0.5.16 in
    `__post_init__`."""
    if hasattr(sa, "resolve_once"):
        sa.resolve_once()
    return sa


LAST = ("device: DFLASH_TREE needs a CUDA device" if OLD else
        "sglang: DFLASH_TREE's worker is written against SGLang 0.5.16-0.5.16")
BAD = [
    ([], "speculative_num_draft_tokens: required"),
    (["--speculative-num-draft-tokens", "600"], r"must be in \[2, 512\]"),
    (["--speculative-num-draft-tokens", "17", "--speculative-eagle-topk", "17"],
     r"speculative_eagle_topk: must be in \[1, 16\]"),
    (["--speculative-num-draft-tokens", "65", "--speculative-eagle-topk", "1"],
     r"node budget 64 exceeds the full top-1 tree of 15 levels \(15 nodes\)"),
    (["--speculative-num-draft-tokens", "17", "--page-size", "16"], "page_size: DFLASH_TREE"),
    (["--speculative-num-draft-tokens", "17", "--speculative-use-rejection-sampling"],
     "speculative_use_rejection_sampling: DFLASH_TREE needs it off"),
    (["--speculative-num-draft-tokens", "17", "--speculative-eagle-topk", "4"], LAST),
    # fa3 verifies trees only with top-K > 1 (its cascade); with it, only the device is left
    (["--speculative-num-draft-tokens", "9", "--speculative-eagle-topk", "1",
      "--attention-backend", "fa3"],
     r"attention_backend: DFLASH_TREE needs --speculative-eagle-topk > 1 with fa3"),
    (["--speculative-num-draft-tokens", "17", "--speculative-eagle-topk", "4",
      "--attention-backend", "fa3"], LAST),
]


@pytest.mark.parametrize("extra,message", BAD)
def test_launch_validation_errors(extra, message):
    register()
    with pytest.raises(ConfigError, match=message):
        _server_args("--device", "cpu", *extra)


def test_launch_validation_checks_the_drafter_against_the_target(tmp_path):
    import json
    import shutil

    register()
    bad = tmp_path / "draft"
    shutil.copytree(DRAFT, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "hidden_size": cfg["hidden_size"] * 2}))
    from sglang.srt.server_args import prepare_server_args

    with pytest.raises(ConfigError, match="hidden_size"):
        _resolved(prepare_server_args([
            "--model-path", str(TARGET), "--speculative-algorithm", "DFLASH_TREE",
            "--speculative-draft-model-path", str(bad), "--speculative-num-draft-tokens", "17",
            "--device", "cpu"]))


def _interpreted(kernel):
    from triton.runtime.interpreter import InterpretedFunction

    return kernel if isinstance(kernel, InterpretedFunction) else InterpretedFunction(kernel.fn)


def _sglang_greedy(t, choice):
    """SGLang's greedy tree verify (its Triton kernel, interpreted) on our tensors."""
    from sglang.kernels.ops.speculative.spec_tree import verify_tree_greedy_kernel_triton

    bs, w = t.retrieve_index.shape
    predicts = torch.zeros(bs * w, dtype=torch.int32)
    accept_index = torch.full((bs, t.max_tree_depth), -1, dtype=torch.int32)
    accept_num = torch.zeros(bs, dtype=torch.int32)
    _interpreted(verify_tree_greedy_kernel_triton)[(bs,)](
        predicts, accept_index, accept_num, t.draft_token.view(bs, w), t.retrieve_index,
        t.retrieve_next_token, t.retrieve_next_sibling, choice,
        batch_size=bs, num_speculative_tokens=t.max_tree_depth, num_draft_tokens=w)
    return predicts, accept_index, accept_num


@pytest.mark.parametrize("bs,g,k,n,vocab", [(1, 4, 2, 5, 13), (5, 15, 4, 32, 151),
                                            (3, 7, 3, 16, 8193)])
def test_sglang_greedy_tree_verify_accepts_walk_tree_path(bs, g, k, n, vocab):
    gen = torch.Generator().manual_seed(n)
    top_lp, top_ids = torch.randn(bs, g, vocab, generator=gen).log_softmax(-1).topk(k, -1)
    tokens, parents, depths = build_tree(top_lp, top_ids, n)
    seq_lens = torch.randint(3, 30, (bs,), generator=gen)
    root = torch.randint(0, vocab, (bs,), generator=gen)
    t = build_verify_tensors(tokens, parents, depths, root, seq_lens, int(seq_lens.sum()), g)
    for trial in range(6):
        choice = torch.randint(0, vocab, (bs, n + 1), generator=gen)
        for b in range(bs):  # mostly follow a child, so long paths get accepted
            for node in range(n + 1):
                kids = [int(tokens[b, i]) for i in range(n) if int(parents[b, i]) == node]
                if kids and torch.rand((), generator=gen) < 0.8:
                    choice[b, node] = kids[int(torch.randint(len(kids), (), generator=gen))]
        predicts, accept_index, accept_num = _sglang_greedy(t, choice)
        for b in range(bs):
            tree = Tree(tokens[b].tolist(), parents[b].tolist(), depths[b].tolist())
            path, bonus = walk_tree(tree, choice[b].tolist())
            a = int(accept_num[b])
            assert a == len(path), (trial, b)
            glob = accept_index[b, :a + 1].tolist()
            assert glob == [b * (n + 1) + i for i in [0] + path], (trial, b)
            # committed tokens: the path's drafts, then the bonus (what SGLang emits)
            out = [int(predicts[i]) for i in glob]
            assert out == [tree.tokens[i - 1] for i in path] + [bonus], (trial, b)


RECONSTRUCT = """
import sys, types, inspect, torch, triton
stub = types.ModuleType("sgl_kernel")
stub.speculative = types.ModuleType("sgl_kernel.speculative")
stub.speculative.reconstruct_indices_from_tree_mask = None
sys.modules.update({"sgl_kernel": stub, "sgl_kernel.speculative": stub.speculative})
from sglang.kernels.ops.speculative.reconstruct_tree import _reconstruct_tree_mask_kernel as k
from dflash_plugin.engines.sglang_tree_input import build_verify_tensors
from dflash_plugin.fast.tree_build import build_tree
assert list(inspect.signature(k.fn).parameters)[:6] == ["tree_mask_ptr", "verified_seq_len_ptr",
    "positions_ptr", "retrieve_index_ptr", "retrieve_next_token_ptr", "retrieve_next_sibling_ptr"]
gen = torch.Generator().manual_seed(3)
for bs, g, kk, n in [(4, 9, 3, 24), (1, 3, 2, 1), (3, 15, 8, 63)]:
    top_lp, top_ids = torch.randn(bs, g, 97, generator=gen).log_softmax(-1).topk(kk, -1)
    tokens, parents, depths = build_tree(top_lp, top_ids, n)
    seq_lens = torch.randint(1, 50, (bs,), generator=gen)
    t = build_verify_tensors(tokens, parents, depths, torch.zeros(bs, dtype=torch.long),
                             seq_lens, int(seq_lens.sum()), g)
    w = n + 1
    out = [torch.empty(bs * w, dtype=torch.int64) for _ in range(4)]
    k[(bs,)](t.anc.contiguous().view(-1), seq_lens, *out, n=w, BLOCK_N=triton.next_power_of_2(w))
    assert out[0].tolist() == t.positions.tolist(), "positions"
    for o, mine in zip(out[1:], (t.retrieve_index, t.retrieve_next_token,
                                 t.retrieve_next_sibling)):
        assert o.view(bs, w).tolist() == mine.tolist(), (o.view(bs, w), mine)
print("RECONSTRUCT-OK")
"""


@pytest.mark.skipif(OLD, reason="SGLang 0.5.16 has no Triton tree-link reconstruction")
def test_links_equal_sglang_reconstruction_from_the_mask():
    """0.5.23's NGRAM kernel (`reconstruct_tree.py`, Triton) rebuilds positions and retrieve
    links from a [bs, W, W] ancestor mask; from our mask it must give our links (the same
    contract). It calls triton's own jit'd helpers, so it runs in a TRITON_INTERPRET=1
    subprocess; a stub `sgl_kernel` makes the module importable (its CUDA op is not used)."""
    import os
    import subprocess

    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", RECONSTRUCT], env=env, capture_output=True,
                          text=True, timeout=300)
    assert "RECONSTRUCT-OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_verify_input_is_an_eagle_verify_input():
    from sglang.srt.speculative.eagle_info import EagleVerifyInput
    from sglang.srt.speculative.spec_info import SpecInputType

    from dflash_plugin.engines.sglang_tree_input import make_verify_input

    tokens, parents, depths = torch.tensor([[4, 5, 6]]), torch.tensor([[0, 0, 1]]), \
        torch.tensor([[1, 1, 2]])
    t = build_verify_tensors(tokens, parents, depths, torch.tensor([3]), torch.tensor([7]), 7, 2)
    v = make_verify_input(t, seq_lens_sum=7, seq_lens_cpu=torch.tensor([7]), topk=2)
    assert isinstance(v, EagleVerifyInput) and v.spec_input_type == SpecInputType.EAGLE_VERIFY
    assert (v.max_tree_depth, v.tree_topk, v.draft_token_num, v.num_tokens_per_req) == (3, -1, 4, 4)
    assert v.topk == 2  # > 1: SGLang's tree-path KV compaction stays on
