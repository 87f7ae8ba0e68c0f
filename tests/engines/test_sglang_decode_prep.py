"""`engines.sglang_decode_prep` without SGLang: the DFLASH_FAST_DECODE_PREP switch (its refusal
at launch: `test_sglang_launch_flags.py`) and `plan`'s numbers against a loop written as DFLASH's
method reads. That the hook's work equals SGLang 0.5.16's own
`DFlashDraftInputV2.prepare_for_decode` is checked in `sglang_env/checks_decode_prep.py`."""

import types

import pytest

from dflash_plugin.engines.sglang_decode_prep import mode, plan
from dflash_plugin.errors import ConfigError


def test_flag_values():
    """Unset or blank is auto; auto, 0, 1 and check pass; anything else a ConfigError naming
    the variable and the allowed values."""
    assert mode({}) == "auto" and mode({"DFLASH_FAST_DECODE_PREP": " "}) == "auto"
    for v in ("0", "1", "check", "CHECK", "Auto"):
        assert mode({"DFLASH_FAST_DECODE_PREP": v}) == v.lower()
    with pytest.raises(ConfigError, match="DFLASH_FAST_DECODE_PREP.*auto, 0, 1 or check.*'yes'"):
        mode({"DFLASH_FAST_DECODE_PREP": "yes"})


def req(committed, allocated, top_k):
    return types.SimpleNamespace(kv_committed_len=committed,
                                 kv=types.SimpleNamespace(kv_allocated_len=allocated),
                                 sampling_params=types.SimpleNamespace(top_k=top_k))


def loop_reference(reqs, w):
    """DFLASH's method's loop, request by request (SGLang 0.5.16, `dflash_info_v2.py`)."""
    out = {"committed": [], "allocated": [], "reserved": [], "needed": 0, "max_top_k": 1}
    uniform, first = True, None
    for i, r in enumerate(reqs):
        c, a = int(r.kv_committed_len), int(r.kv.kv_allocated_len)
        res = max(a, c + 2 * w)
        out["committed"].append(c)
        out["allocated"].append(a)
        out["reserved"].append(res)
        out["needed"] += res - a
        out["max_top_k"] = max(out["max_top_k"], int(r.sampling_params.top_k))
        if i == 0:
            first = int(r.sampling_params.top_k)
        elif int(r.sampling_params.top_k) != first:
            uniform = False
    out["uniform_top_k"] = first if uniform else None
    return out


@pytest.mark.parametrize("w", [1, 16, 32])
def test_plan_equals_the_loop(w):
    """Reserved = max(allocated, committed + 2 W); a request already reserved far enough needs
    nothing; top-k -1 (off) leaves the maximum at 1; mixed top-k is not uniform."""
    cases = [[req(10, 10, 1)], [req(5, 200, -1), req(7, 7, -1)],
             [req(3, 40, 20), req(90, 120, 1), req(0, 0, 20)], [req(i, i + 3 * i % 50, 5)
                                                              for i in range(64)]]
    for reqs in cases:
        assert plan(reqs, w) == loop_reference(reqs, w)
