"""`engines.sglang_tune`'s staggered output lengths (`--length-spread` of
`benchmarks/gpu_adaptive_sglang.py`): the lengths, and that the closed loop asks each request
for its own. The engine is a stand-in (MOCK: SGLang's `Engine` needs a GPU for DFLASH) with the
two members the loop uses, `loop` and `async_generate`."""

import asyncio
import types

import pytest

from dflash_plugin.engines.sglang_tune import closed_loop, spread_lengths
from dflash_plugin.errors import ConfigError


def test_lengths_cover_the_range_interleaved_and_keep_the_mean():
    got = spread_lengths(128, 128, 0.5)
    assert got == spread_lengths(128, 128, 0.5)  # the same list for every mode and server
    assert min(got) >= 64 and max(got) <= 192 and max(got) - min(got) >= 120
    assert abs(sum(got) / len(got) - 128) < 2
    assert all(a != b for a, b in zip(got, got[1:]))  # neighbours finish at different steps
    assert spread_lengths(5, 128, 0.0) == [128] * 5 and spread_lengths(1, 7, 0.5) == [7]
    assert min(spread_lengths(64, 2, 0.9)) >= 1


@pytest.mark.parametrize("spread", [-0.1, 1.0, 1.5])
def test_bad_spread_is_a_config_error(spread):
    with pytest.raises(ConfigError, match=r"length_spread.*\[0, 1\)"):
        spread_lengths(4, 128, spread)


def test_closed_loop_gives_each_request_its_length():
    asked, inflight, peak = [], [0], [0]

    async def generate(input_ids, sampling_params):
        inflight[0] += 1
        peak[0] = max(peak[0], inflight[0])
        await asyncio.sleep(0)
        inflight[0] -= 1
        asked.append((input_ids[0], sampling_params["max_new_tokens"],
                      sampling_params["ignore_eos"]))
        n = sampling_params["max_new_tokens"]
        return {"output_ids": [input_ids[0]] * n, "meta_info": {"spec_verify_ct": n}}

    engine = types.SimpleNamespace(loop=asyncio.new_event_loop(), async_generate=generate)
    try:
        prompts = [[i] for i in range(6)]
        done = closed_loop(engine, prompts, [3, 9, 4, 8, 5, 7], 2)
        assert sorted(asked) == [(0, 3, True), (1, 9, True), (2, 4, True), (3, 8, True),
                                 (4, 5, True), (5, 7, True)] and peak[0] == 2
        assert [len(d.token_ids) for d in done] == [3, 9, 4, 8, 5, 7]
        assert [len(d.token_ids) for d in closed_loop(engine, prompts[:2], 4, 2)] == [4, 4]
    finally:
        engine.loop.close()
