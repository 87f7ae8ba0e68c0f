"""`engines.sglang_plain_attention` without SGLang: the q = 1 state's target backend attends a
one-token verify as a decode step. The base class here is a stand-in with the method names of
SGLang 0.5.16's FA3 backend (named `FlashAttentionBackend` as SGLang's class is; no kernels: it
records what it is asked); that the real class has these members, with these parameters, is
checked against SGLang's source in `sglang_env/checks_adaptive.py`. On a GPU: the queue steps
`kernels-q1-plainattn-8b` and `adaptive-8b-plainattn` (`benchmarks/gpu_queue/sglang.sh`)."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from dflash_plugin.engines import sglang_plain_attention as pa
from dflash_plugin.errors import ConfigError


@dataclasses.dataclass
class Metadata:  # the fields of SGLang's FlashAttentionMetadata the subclass reads
    max_seq_len_q: int
    cache_seqlens_int32: torch.Tensor
    cu_seqlens_q: torch.Tensor
    scheduler_metadata: torch.Tensor | None = None


class FlashAttentionBackend:
    """Stand-in for SGLang's FA3 backend (see the module docstring)."""

    fa_impl_ver, use_mla, topk, max_context_len = 3, False, 1, 4096

    def __init__(self, q_len=1, buf=16, sched=True):
        self.q_len, self.sched, self.calls, self.forward_metadata = q_len, sched, [], None
        self._sched_meta_buf = torch.full((buf,), -1, dtype=torch.int32) if buf else None
        self.graph_metadata = {}  # bs -> the metadata object its graph was captured with

    def _metadata(self, fb, md=None):
        bs = len(fb.seq_lens)
        md = md or Metadata(self.q_len, torch.zeros(bs, dtype=torch.int32),
                            torch.arange(bs + 1, dtype=torch.int32) * self.q_len)
        md.cache_seqlens_int32.copy_(fb.seq_lens + self.q_len)
        return md

    def init_forward_metadata(self, fb):
        self.forward_metadata = self._metadata(fb)

    def init_forward_metadata_out_graph(self, fb, in_capture=False):
        bs = len(fb.seq_lens)
        if in_capture:
            self.graph_metadata[bs] = self._metadata(fb)
        self.forward_metadata = self._metadata(fb, self.graph_metadata[bs])

    def _compute_scheduler_metadata(self, batch_size, max_seq_len_k, cache_seqlens,
                                    cu_seqlens_q):
        self.calls.append(("sched", batch_size, max_seq_len_k))
        if not self.sched:
            return None
        return torch.tensor([batch_size, max_seq_len_k, int(cache_seqlens.sum())],
                            dtype=torch.int32)

    def forward_decode(self, q, k, v, layer, fb, save_kv_cache=True, **kw):
        self.calls.append(("decode", save_kv_cache, kw))
        return "decode"

    def forward_extend(self, q, k, v, layer, fb, save_kv_cache=True, **kw):
        self.calls.append(("extend", save_kv_cache, kw))
        return "extend"


def batch(lens, verify=True, host=True):
    mode = SimpleNamespace(is_target_verify=lambda: verify)
    lens = torch.tensor(lens)
    return SimpleNamespace(forward_mode=mode, seq_lens=lens,
                           seq_lens_cpu=lens + 1 if host else None)  # DFLASH's host bound


def test_env_flag_is_off_by_default():
    assert not pa.enabled({}) and pa.enabled({pa.ENV: "1"}) and not pa.enabled({pa.ENV: "0"})
    with pytest.raises(ConfigError, match=f"{pa.ENV}: must be 0 or 1 .*, got 'yes'"):
        pa.enabled({pa.ENV: "yes"})


def test_only_fa3_without_mla_or_tree_is_changed():
    assert pa.why_not(FlashAttentionBackend()) is None
    assert "is not SGLang's FA3" in pa.why_not(SimpleNamespace())
    fa4 = FlashAttentionBackend()
    fa4.fa_impl_ver = 4
    tree = FlashAttentionBackend()
    tree.topk = 4
    assert pa.why_not(fa4) == "FA4 or MLA" and "topk" in pa.why_not(tree)
    other = SimpleNamespace(x=1)
    assert pa.plain_step_backend(other) is other and type(other) is SimpleNamespace


def test_a_one_token_verify_attends_as_a_decode_step():
    """Eager: SGLang's metadata, then FA3's schedule for it (cache bound: host lengths + 1);
    the attention goes to the decode path with every argument; a prefill and a verify of two
    tokens per request stay on the extend path, unscheduled."""
    be = pa.plain_step_backend(FlashAttentionBackend())
    assert type(be).__name__ == "PlainStepFlashAttentionBackend"
    be.init_forward_metadata(batch([5, 9]))
    md = be.forward_metadata
    assert be.calls == [("sched", 2, 11)]  # max(seq_lens_cpu = lens + 1) + 1
    assert md.scheduler_metadata.tolist() == [2, 11, 16]  # cache lens (5 + 1) + (9 + 1)
    out = be.forward_extend("q", "k", "v", "layer", batch([5, 9]), False, sinks="s")
    assert out == "decode" and be.calls[-1] == ("decode", False, {"sinks": "s"})
    assert be.forward_extend("q", "k", "v", "layer", batch([5], verify=False)) == "extend"
    wide = pa.plain_step_backend(FlashAttentionBackend(q_len=2))
    wide.init_forward_metadata(batch([5]))
    assert wide.forward_metadata.scheduler_metadata is None and wide.calls == []
    assert wide.forward_extend("q", "k", "v", "layer", batch([5])) == "extend"


def test_graph_capture_binds_sglangs_buffer_and_replay_refills_it():
    """At capture the metadata points at SGLang's persistent buffer (the rest zeroed); each
    replay refills it in place with the new batch's schedule; no host lengths: the context
    limit bounds the cache, as SGLang does for a decode batch."""
    be = pa.plain_step_backend(FlashAttentionBackend())
    be.init_forward_metadata_out_graph(batch([3, 3]), in_capture=True)
    md, buf = be.forward_metadata, be._sched_meta_buf
    assert md.scheduler_metadata.data_ptr() == buf.data_ptr()
    assert buf[:3].tolist() == [2, 5, 8] and buf[3:].eq(0).all()
    be.init_forward_metadata_out_graph(batch([7, 20], host=False))
    assert be.forward_metadata is md and md.scheduler_metadata.data_ptr() == buf.data_ptr()
    assert buf[:3].tolist() == [2, 4096, 29]


def test_graph_without_a_buffer_or_a_schedule_keeps_sglangs_verify():
    """No persistent buffer (or SGLang's precompute off: no schedule): the metadata stays
    without one, and replays do not compute one."""
    for be in (pa.plain_step_backend(FlashAttentionBackend(buf=0)),
               pa.plain_step_backend(FlashAttentionBackend(sched=False))):
        be.init_forward_metadata_out_graph(batch([3]), in_capture=True)
        assert be.forward_metadata.scheduler_metadata is None
        n = len(be.calls)
        be.init_forward_metadata_out_graph(batch([4]))
        assert be.forward_metadata.scheduler_metadata is None and len(be.calls) == n
    eager = pa.plain_step_backend(FlashAttentionBackend(sched=False))
    eager.init_forward_metadata(batch([3]))
    assert eager.forward_metadata.scheduler_metadata is None


def test_the_swap_keeps_the_object_and_shares_one_class_per_base():
    a, b = FlashAttentionBackend(), FlashAttentionBackend()
    a.marker = "kept"
    assert pa.plain_step_backend(a) is a and a.marker == "kept"
    assert type(pa.plain_step_backend(b)) is type(a)
    assert isinstance(a, FlashAttentionBackend)
