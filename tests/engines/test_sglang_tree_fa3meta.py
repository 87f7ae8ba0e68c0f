"""fa3's tree-verify metadata as one CUDA graph per batch size (`sglang_tree_fa3meta`) without
SGLang: the gate (`graphable`), the flag's errors, and `run_graphed` over a stand-in backend and
a stand-in graph runner that runs a capture's warm-up eagerly as CUDA's does: one capture per
batch size, replays after it, the backend's Python attributes restored after each replay, and
eager calls when the inputs are not the captured tensors. SGLang 0.5.16's side (the hooked
method, its keyword call, what its top-K > 1 branch reads): `sglang_env/checks_tree_fa3.py`."""

from types import SimpleNamespace as _ns

import pytest
import torch

from dflash_plugin.engines import sglang_tree_fa3meta as m
from dflash_plugin.errors import ConfigError


class Mode:
    def __init__(self, verify):
        self.verify = verify

    def is_target_verify(self):
        return self.verify


class Backend:
    """What the hooked method reads and sets; `calls` counts its runs."""

    def __init__(self):
        self.topk, self.is_draft_runner = 4, False
        self.use_sliding_window_kv_pool = self.has_swa = False
        self.cuda_graph_custom_mask = torch.zeros(64, dtype=torch.bool)
        self.metadata = {bs: (f"normal{bs}", f"expand{bs}") for bs in (1, 2, 4)}
        self.forward_metadata = self.forward_metadata_spec_decode_expand = None
        self.calls = 0


def original(backend, **kw):
    backend.calls += 1
    backend.forward_metadata, backend.forward_metadata_spec_decode_expand = \
        backend.metadata[kw["bs"]]


class Runner:
    """Stand-in for `StepGraphs`: a key's first run calls its function twice (the capture's
    eager warm-up, then the first replay), later runs once."""

    def __init__(self, device, enabled, capture_error_mode):
        self.enabled, self.graphs = enabled, {}

    def run(self, key, fn):
        if key not in self.graphs:
            fn()
            self.graphs[key] = fn
        fn()


def _kw(backend, bs, rows, lens, mask=None, raw=None):
    """A replay's call at graph batch `bs` for `raw` requests (default bs), W = 5."""
    return dict(bs=bs, req_pool_indices=rows[:bs], seq_lens=lens[:bs], seq_lens_sum=None,
                encoder_lens=None, forward_mode=Mode(True), seq_lens_cpu=None, out_cache_loc=None,
                spec_info=_ns(custom_mask=backend.cuda_graph_custom_mask if mask is None else mask,
                              positions=torch.zeros((raw or bs) * 5)))


def test_flag():
    assert m.enabled({}) is False and m.enabled({m.ENV: "1"}) is True
    assert m.mode({m.ENV: "check"}) == "check" and m.enabled({m.ENV: "check"})
    with pytest.raises(ConfigError, match=m.ENV):
        m.enabled({m.ENV: "yes"})


def test_gate_takes_only_the_tree_verify_with_its_own_mask_buffer():
    be, rows, lens = Backend(), torch.zeros(8, dtype=torch.long), torch.ones(8, dtype=torch.long)
    kw = _kw(be, 2, rows, lens)
    assert m.graphable(be, kw, "DFLASH_TREE")
    assert not m.graphable(be, kw, "EAGLE") and not m.graphable(be, kw, None)
    assert not m.graphable(be, {**kw, "forward_mode": Mode(False)}, "DFLASH_TREE")
    assert not m.graphable(be, {**kw, "seq_lens_cpu": lens}, "DFLASH_TREE")
    assert not m.graphable(be, {**kw, "encoder_lens": lens}, "DFLASH_TREE")
    assert not m.graphable(be, _kw(be, 2, rows, lens, mask=torch.zeros(64, dtype=torch.bool)),
                           "DFLASH_TREE")  # a mask of its own (a batch past the graphs)
    for attr, value in (("topk", 1), ("is_draft_runner", True), ("has_swa", True),
                        ("use_sliding_window_kv_pool", True)):
        other = Backend()
        setattr(other, attr, value)
        assert not m.graphable(other, kw, "DFLASH_TREE"), attr


def test_one_capture_per_batch_size_and_the_attributes_after_a_replay():
    be, rows, lens = Backend(), torch.zeros(8, dtype=torch.long), torch.ones(8, dtype=torch.long)
    for bs in (1, 2, 1, 4, 2, 2):
        calls = be.calls
        be.forward_metadata = be.forward_metadata_spec_decode_expand = "stale"
        assert m.run_graphed(original, be, _kw(be, bs, rows, lens), Runner) is None
        assert (be.forward_metadata, be.forward_metadata_spec_decode_expand) == be.metadata[bs]
        assert be.calls - calls in (1, 2)  # a replay, or a capture's warm-up and first replay
    runner, done = m._GRAPHS[id(be)]
    assert sorted(runner.graphs) == sorted(done) == [(1, 5), (2, 10), (4, 20)]
    # 3 requests in the graph of 4: its own graph (the mask rows read depend on it)
    m.run_graphed(original, be, _kw(be, 4, rows, lens, raw=3), Runner)
    assert sorted(runner.graphs) == [(1, 5), (2, 10), (4, 15), (4, 20)]
    # other input tensors for a captured key: SGLang's eager call, no second capture
    other = torch.zeros(8, dtype=torch.long)
    calls = be.calls
    m.run_graphed(original, be, _kw(be, 2, other, lens), Runner)
    assert len(runner.graphs) == 4 and be.calls == calls + 1
    assert be.forward_metadata == be.metadata[2][0]
    m._GRAPHS.pop(id(be))


def test_off_cuda_runs_eagerly(monkeypatch):
    be, rows, lens = Backend(), torch.zeros(8, dtype=torch.long), torch.ones(8, dtype=torch.long)
    monkeypatch.setattr(m, "_algorithm", lambda: "EAGLE")
    m.replay_metadata(original, be, **_kw(be, 2, rows, lens))  # another algorithm's
    assert be.calls == 1 and id(be) not in m._GRAPHS
    m.run_graphed(original, be, _kw(be, 2, rows, lens))  # real StepGraphs, off CUDA: eager
    assert be.calls == 2 and be.forward_metadata == be.metadata[2][0]
    m._GRAPHS.pop(id(be))


def test_check_mode_compares_the_replay_with_sglangs_call():
    """`check`: after each replay SGLang's eager call runs, and a difference raises."""
    be, rows, lens = Backend(), torch.zeros(8, dtype=torch.long), torch.ones(8, dtype=torch.long)
    be.metadata = {2: (_ns(page_table=torch.zeros(3)), _ns(page_table=torch.zeros(3)))}
    m.run_graphed(original, be, _kw(be, 2, rows, lens), Runner, check=True)
    replays = []

    def drifting(backend, **kw):  # the eager call writes something else than the replay did
        original(backend, **kw)
        replays.append(1)
        if len(replays) > 1:
            backend.metadata[2][1].page_table += 1

    with pytest.raises(RuntimeError, match="differs"):
        m.run_graphed(drifting, be, _kw(be, 2, rows, lens), Runner, check=True)
    m._GRAPHS.pop(id(be))


def test_the_graphed_call_reads_the_whole_mask_buffer():
    """The round's mask is a prefix of the backend's buffer that grows round by round; a graph
    captured over one round's prefix keeps its size (on the H200 a later round's gather then
    failed its bounds check), so the graphed call sees the whole buffer, and the round's own
    prefix is back afterwards (check mode's eager call reads that)."""
    be, rows, lens = Backend(), torch.zeros(8, dtype=torch.long), torch.ones(8, dtype=torch.long)
    be.metadata = {2: (_ns(page_table=torch.zeros(3)), _ns(page_table=torch.zeros(3)))}
    seen = []

    def recording(backend, **kw):
        seen.append(kw["spec_info"].custom_mask.numel())
        original(backend, **kw)

    for total in (12, 30):  # two rounds: the prefix grows
        kw = _kw(be, 2, rows, lens, mask=be.cuda_graph_custom_mask[:total])
        assert m.graphable(be, kw, "DFLASH_TREE")
        m.run_graphed(recording, be, kw, Runner, check=True)
        assert kw["spec_info"].custom_mask.numel() == total
    assert seen == [64, 64, 12, 64, 30]  # warm-up, replay, check; replay, check
    m._GRAPHS.pop(id(be))
