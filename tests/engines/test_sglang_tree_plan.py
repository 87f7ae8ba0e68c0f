"""DFLASH_TREE's sync-free tree-verify plan (`dflash_plugin/engines/sglang_tree_plan.py`) without
SGLang or a GPU: the host layout against the device's index pointers, the device mask packing
against numpy's `packbits(bitorder="little")` per segment (flashinfer's `segment_packbits`
semantics), and the plan's routing. SGLang's `fast_prefill_plan` and the wrapper's own plan are
stand-ins here (they need CUDA and flashinfer); their signatures against 0.5.16's source are
checked in `sglang_env/checks_tree_worker.py`."""

import numpy as np
import pytest
import torch

from dflash_plugin.engines.sglang_tree_plan import (
    PlanLayout,
    check_layout,
    host_layout,
    layout_from_env,
    mask_indptrs,
    pack_mask_bits,
    tree_verify_plan,
)


def test_host_layout_pads_graph_rows_with_the_fill_value():
    qo, kv_indptr, kv = host_layout([5, 9], padded_bs=4, fill=1, width=3)
    assert qo.tolist() == [0, 3, 6, 9, 12]
    assert kv.tolist() == [8, 12, 4, 4] and kv_indptr.tolist() == [0, 8, 20, 24, 28]
    assert qo.dtype == kv.dtype == kv_indptr.dtype == torch.int32
    with pytest.raises(ValueError, match="3 requests do not fit a graph of 2 rows"):
        host_layout([1, 2, 3], padded_bs=2, fill=1, width=3)


@pytest.mark.parametrize("q_lens,kv_lens", [([3], [10]), ([5, 5, 5], [7, 1, 12]),
                                            ([33, 33], [1057, 40]), ([1], [1])])
def test_pack_mask_bits_equals_numpy_packbits_per_segment(q_lens, kv_lens):
    gen = torch.Generator().manual_seed(len(q_lens))
    bits = [q * k for q, k in zip(q_lens, kv_lens)]
    mask = torch.rand(sum(bits) + 13, generator=gen) < 0.5  # a larger buffer, as SGLang's
    qo = torch.tensor([0, *np.cumsum(q_lens)], dtype=torch.int32)
    kv_indptr = torch.tensor([0, *np.cumsum(kv_lens)], dtype=torch.int32)
    bit_ptr, byte_ptr = mask_indptrs(qo, kv_indptr, torch.ones(len(q_lens), dtype=torch.int32))
    assert bit_ptr.tolist() == [0, *np.cumsum(bits)]
    assert byte_ptr.tolist() == [0, *np.cumsum([(b + 7) // 8 for b in bits])]
    n_bytes = int(byte_ptr[-1])
    out = torch.full((n_bytes + 5,), 0xAB, dtype=torch.uint8)
    packed = pack_mask_bits(mask, bit_ptr, byte_ptr, sum(bits), n_bytes, out)
    want, at = [], 0
    for b in bits:
        want += np.packbits(mask[at:at + b].numpy(), bitorder="little").tolist()
        at += b
    assert packed.tolist() == want
    assert out[n_bytes:].tolist() == [0xAB] * 5  # nothing past the packed bytes


class Wrapper:  # stand-in for flashinfer's wrapper: the two graph mask buffers only
    def __init__(self, bs, mask_bytes):
        self._custom_mask_buf = torch.zeros(mask_bytes, dtype=torch.uint8)
        self._mask_indptr_buf = torch.zeros(bs + 1, dtype=torch.int32)


def test_plan_routes_to_the_fast_plan_with_host_layout_and_packs_the_mask():
    """Known layout: SGLang's fast plan (stand-in) gets the host pointers, lengths and maxima
    with the call's other arguments; the mask buffer and its byte pointers are filled. Unknown
    (no seq_lens_cpu, more requests than graph rows, no mask): the wrapper's own plan."""
    w, seq, width = 3, [4, 6], 3
    calls = []
    fast = lambda *a, **kw: calls.append(("fast", a, kw))  # noqa: E731
    own = lambda *a, **kw: calls.append(("own", a, kw))  # noqa: E731
    qo, kv_indptr, kv = host_layout(seq, padded_bs=w, fill=1, width=width)
    bits = int((width * kv).sum())
    mask = torch.arange(bits) % 3 == 0
    wrapper = Wrapper(w, 64)
    layout = PlanLayout(width, fill=1, seq_lens_cpu=torch.tensor(seq))
    args = (qo, kv_indptr, torch.arange(int(kv.sum()), dtype=torch.int32),
            torch.ones(w, dtype=torch.int32), 32, 8, 128, 1)
    tree_verify_plan(wrapper, *args, layout=layout, fast_plan=fast, own_plan=own,
                     custom_mask=mask, q_data_type=torch.bfloat16, non_blocking=True)
    ((kind, a, kw),) = calls
    assert kind == "fast" and a[0] is wrapper and a[1] is qo and a[8] == 1
    assert kw["qo_indptr_host"].tolist() == qo.tolist()
    assert kw["kv_indptr_host"].tolist() == kv_indptr.tolist()
    assert kw["kv_lens_host"].tolist() == [7, 9, 4] and kw["max_kv_len"] == 9
    assert kw["max_q_len"] == width and kw["q_data_type"] == torch.bfloat16
    assert "custom_mask" not in kw
    byte_ptr = [0, 3, 7, 9]  # 21, 27, 12 bits
    assert wrapper._mask_indptr_buf.tolist() == byte_ptr
    want = []
    for s, e in zip([0, 21, 48], [21, 48, 60]):
        want += np.packbits(mask[s:e].numpy(), bitorder="little").tolist()
    assert wrapper._custom_mask_buf[:9].tolist() == want
    for lay, m in ((PlanLayout(width), mask), (PlanLayout(width, seq_lens_cpu=torch.arange(4)),
                                                mask), (layout, None)):
        calls.clear()
        tree_verify_plan(wrapper, *args, layout=lay, fast_plan=fast, own_plan=own,
                         custom_mask=m, non_blocking=True)
        ((kind, a, kw),) = calls
        assert kind == "own" and a[0] is qo and kw["custom_mask"] is m


def test_plan_packs_in_place_when_the_mask_is_the_wrappers_buffer():
    """SGLang 0.5.16 hands the verify its graph mask buffer to fill (`cuda_graph_custom_mask`,
    uint8 0 / 1) and gives the same tensor to the wrappers as their packed-mask buffer: the
    packing must read the whole mask before it writes the first byte."""
    seq, width, w = [30, 3], 5, 2
    _, kv_indptr, kv = host_layout(seq, padded_bs=w, fill=1, width=width)
    bits = int((width * kv).sum())
    gen = torch.Generator().manual_seed(3)
    buf = (torch.rand(bits + 40, generator=gen) < 0.5).to(torch.uint8)
    original = buf.clone()
    wrapper = Wrapper(w, 1)
    wrapper._custom_mask_buf = buf  # one tensor: the bool mask in, the packed bytes out
    qo = torch.arange(0, (w + 1) * width, width, dtype=torch.int32)
    tree_verify_plan(wrapper, qo, kv_indptr, torch.zeros(int(kv.sum()), dtype=torch.int32),
                     torch.ones(w, dtype=torch.int32), 4, 4, 8, 1,
                     layout=PlanLayout(width, seq_lens_cpu=torch.tensor(seq)),
                     fast_plan=lambda *a, **k: None, own_plan=None, custom_mask=buf)
    first = width * (seq[0] + width)
    want = (np.packbits(original[:first].numpy(), bitorder="little").tolist()
            + np.packbits(original[first:bits].numpy(), bitorder="little").tolist())
    assert buf[: len(want)].tolist() == want


def test_check_layout_raises_on_a_layout_or_mask_difference():
    kv_indptr = torch.tensor([0, 8, 12], dtype=torch.int32)
    packed = torch.tensor([1, 2], dtype=torch.uint8)
    check_layout(kv_indptr, kv_indptr.clone(), packed, packed.clone())  # equal: silent
    with pytest.raises(RuntimeError, match=r"kv_indptr \[0, 8, 12\] on the device, \[0, 8, 13\]"):
        check_layout(kv_indptr, torch.tensor([0, 8, 13], dtype=torch.int32), packed, packed)
    with pytest.raises(RuntimeError, match="packed mask differs"):
        check_layout(kv_indptr, kv_indptr, packed, torch.tensor([1, 3], dtype=torch.uint8))


def test_layout_from_env(monkeypatch):
    monkeypatch.delenv("DFLASH_TREE_HOST_PLAN", raising=False)
    monkeypatch.delenv("DFLASH_TREE_HOST_PLAN_CHECK", raising=False)
    assert layout_from_env(33) == PlanLayout(33)  # on by default
    monkeypatch.setenv("DFLASH_TREE_HOST_PLAN", "0")
    assert layout_from_env(33) is None  # flashinfer's own plan
    monkeypatch.setenv("DFLASH_TREE_HOST_PLAN", "1")
    assert layout_from_env(33) == PlanLayout(33)
    monkeypatch.setenv("DFLASH_TREE_HOST_PLAN_CHECK", "1")
    assert layout_from_env(33) == PlanLayout(33, check=True)
