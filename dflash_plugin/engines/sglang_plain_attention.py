"""DFLASH_ADAPTIVE's plain (q = 1) steps attend the way SGLang's own plain decode step does (FA3).

A q = 1 step is DFLASH's verify of one token per request (`ForwardMode.TARGET_VERIFY`), and
SGLang 0.5.16's FA3 backend runs every verify through its extend path: `flash_attn_with_kvcache`
with `cu_seqlens_k_new` and no precomputed scheduler metadata, so FA3 plans its work in every
layer. On an H100 at the Qwen3-8B shape (1 request, 1k context, 2026-12-06) that was 36 planning
kernels (121 us) and 49 us more attention per step than SGLang's plain decode step (6.71 ms):
most of the 1.3 % the q = 1 step still cost over plain with the drafter appends held.

`plain_step_backend(backend)` makes the q = 1 state's own target backend (a fresh one per
state, `sglang_adaptive_worker.build_runner_state`) an instance of a subclass that
(1) after SGLang's metadata of a verify with one query per request (eager, or for CUDA graphs at
capture and at each replay, outside the graph) adds FA3's scheduler metadata the way SGLang does
for a decode batch (at graph capture in SGLang's own persistent buffer, refilled at replay), and
(2) runs such a verify's attention through the backend's decode path, which reads it. The
verify's cache lengths (prefix + 1), page table and single query per request are a decode
step's, so the step attends as plain decoding does. Anything else (prefills, wider verifies)
goes to SGLang's code unchanged; backends other than FA3 without MLA are left as they are.

Off by default (`DFLASH_ADAPTIVE_PLAIN_ATTENTION=1` turns it on). It was on from the
afternoon of 2026-12-06: on an H100 at the Qwen3-8B shape and 64 requests the q = 1 step took
7,545 us of GPU time against SGLang's plain step's 7,539 (8.00 ms of wall time before, 7.80
after, plain 7.78), outputs equal to plain's. The first fixture rows with it on and drafts
accepted (H100, that evening) ran the policy's q = 16 steps slower in every server with it on
(median 3.2-4.5 ms at 16 requests, 5.4-6.0 at 64) than in both servers with it off (2.9-3.0,
3.8-4.8), and their rows 5-15 % below the off servers' at 16 and 64 requests. Four more
servers that night (on / off / on / off) did not repeat it: the second off server ran like the
on servers, so it was the server starts' spread. It stays off: no gain was measured where drafts
are accepted (BENCHMARKS.md).
SGLang is not imported here: the subclass is made from the backend's own class.
"""

from __future__ import annotations

import functools
import logging
import os

from ..errors import env_flag

logger = logging.getLogger(__name__)

ENV = "DFLASH_ADAPTIVE_PLAIN_ATTENTION"
FA3_CLASS = "FlashAttentionBackend"  # sglang.srt.layers.attention.flashattention_backend
NEEDS = ("forward_decode", "forward_extend", "init_forward_metadata",
         "init_forward_metadata_out_graph", "_compute_scheduler_metadata")


def enabled(environ=os.environ) -> bool:
    """`DFLASH_ADAPTIVE_PLAIN_ATTENTION`: 0 (default) or 1; a `ConfigError` otherwise."""
    return env_flag(environ, ENV, "0", "q = 1 steps attend through FA3's decode path")


def one_query_verify(forward_batch, metadata) -> bool:
    """A verify whose metadata holds one query per request (the q = 1 step)."""
    return (metadata is not None and forward_batch.forward_mode.is_target_verify()
            and getattr(metadata, "max_seq_len_q", None) == 1)


def host_max_len(forward_batch, bs: int, fallback: int) -> int:
    """An upper bound of the batch's cache lengths from the host copy of its lengths (+ 1: the
    verified token), else `fallback` (SGLang's rule for a decode batch: its context limit)."""
    lens = getattr(forward_batch, "seq_lens_cpu", None)
    if lens is None or len(lens[:bs]) == 0:
        return fallback
    return int(lens[:bs].max()) + 1


def why_not(backend) -> str | None:
    """Why `backend` cannot take the decode path for its q = 1 steps (None: it can)."""
    names = {c.__name__ for c in type(backend).__mro__}
    if FA3_CLASS not in names:
        return f"{type(backend).__name__} is not SGLang's FA3 backend"
    if getattr(backend, "fa_impl_ver", 3) != 3 or getattr(backend, "use_mla", False):
        return "FA4 or MLA"
    if (getattr(backend, "topk", 1) or 1) > 1:
        return "tree verify (topk > 1)"
    missing = [n for n in NEEDS if not callable(getattr(backend, n, None))]
    return f"the backend lacks {missing}" if missing else None


@functools.cache
def plain_step_class(base: type) -> type:
    """`base` (SGLang's FA3 backend class) with the q = 1 verify attended as a decode step."""

    class PlainStepAttention(base):
        def init_forward_metadata(self, forward_batch):
            super().init_forward_metadata(forward_batch)
            self._add_schedule(forward_batch, graph=False, capture=False)

        def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
            super().init_forward_metadata_out_graph(forward_batch, in_capture=in_capture)
            self._add_schedule(forward_batch, graph=True, capture=in_capture)

        def _add_schedule(self, forward_batch, graph: bool, capture: bool) -> None:
            md = self.forward_metadata
            if not one_query_verify(forward_batch, md):
                return
            if graph and not capture and md.scheduler_metadata is None:
                return  # captured without it: the graph plans per layer, as SGLang's verify
            bs = int(md.cache_seqlens_int32.shape[0])
            max_k = host_max_len(forward_batch, bs, self.max_context_len)
            sched = self._compute_scheduler_metadata(bs, max_k, md.cache_seqlens_int32,
                                                     md.cu_seqlens_q)
            if sched is None:  # precompute off in SGLang (DP attention, context parallel)
                return
            if not graph:
                md.scheduler_metadata = sched
                return
            buf = getattr(self, "_sched_meta_buf", None)  # SGLang's, sized for its graphs
            n = int(sched.shape[0])
            if buf is None or n > buf.shape[0]:
                return
            buf[:n] = sched
            buf[n:] = 0
            if capture:
                md.scheduler_metadata = buf[:n]  # the graph reads this buffer at replay

        def forward_extend(self, q, k, v, layer, forward_batch, *args, **kwargs):
            if one_query_verify(forward_batch, self.forward_metadata):
                return self.forward_decode(q, k, v, layer, forward_batch, *args, **kwargs)
            return super().forward_extend(q, k, v, layer, forward_batch, *args, **kwargs)

    PlainStepAttention.__name__ = PlainStepAttention.__qualname__ = f"PlainStep{base.__name__}"
    return PlainStepAttention


def plain_step_backend(backend):
    """`backend` as a `plain_step_class` instance (the same object, its class swapped before
    anything ran on it), or unchanged with the reason logged where it does not apply."""
    if (why := why_not(backend)) is not None:
        logger.info("%s: q = 1 steps keep SGLang's verify attention: %s", ENV, why)
        return backend
    backend.__class__ = plain_step_class(type(backend))
    return backend
