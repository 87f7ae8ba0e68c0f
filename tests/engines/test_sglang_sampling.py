"""Per-request sampling of the SGLang adapter, without SGLang: how SGLang's resolved sampling
params map to DecodeParams, the request seeds, the random streams across blocks, and the
acceptance replay (`advance`) under sampling. The checks in SGLang's own loops (token identity
with the reference for a fixed seed, the chi-square distribution test, per-request rejection)
are `sglang_env/checks_sampling.py`, run by `test_sglang.py`."""

import torch

from spiffy_plugin.engines.sglang import (
    TOP_K_ALL,
    request_params,
    request_seed,
    rule_params,
    unsupported_sampling,
)
from spiffy_plugin.engines.sglang_drafts import CanvasState, Streams


def test_request_params_follow_sglang_greedy_encoding():
    rule = rule_params("vanilla-1")
    assert request_params(rule, 1.0, 1.0, 1) is rule  # SGLang's temperature 0
    assert request_params(rule, 0.0, 0.5, TOP_K_ALL) is rule
    p = request_params(rule_params("threshold-0.9"), 0.7, 0.9, TOP_K_ALL)
    assert (p.threshold, p.temperature, p.top_p, p.greedy) == (0.9, 0.7, 0.9, False)


def test_unsupported_sampling_and_seeds():
    assert unsupported_sampling(TOP_K_ALL, 0.0) is None and unsupported_sampling(1, 0.0) is None
    assert "top_k=5" in unsupported_sampling(5, 0.0)
    assert "min_p=0.2" in unsupported_sampling(TOP_K_ALL, 0.2)
    assert request_seed(0, "abc") == request_seed(0, "abc") != request_seed(1, "abc")
    assert 0 <= request_seed(3, "abc") < 2**63


def test_streams_persist_per_request_and_never_replay():
    s = Streams(seed=5, capacity=2)
    g = s.get("a", torch.device("cpu"), None, 0)
    first = torch.rand(4, generator=g)
    assert s.get("a", torch.device("cpu"), None, 16) is g  # the next block: the same stream
    ref = torch.Generator().manual_seed(request_seed(5, "a"))
    assert torch.equal(first, torch.rand(4, generator=ref))
    own = s.get("b", torch.device("cpu"), 1234, 0)
    assert torch.equal(torch.rand(3, generator=own),
                       torch.rand(3, generator=torch.Generator().manual_seed(1234)))
    s.get("c", torch.device("cpu"), None, 0)  # capacity 2: "a" goes
    assert "a" not in s.live
    again = s.get("a", torch.device("cpu"), None, 32)  # back: a new stream, not a replay
    assert not torch.equal(torch.rand(4, generator=again), first)
    s.drop("b")
    assert "b" not in s.live and "b" in s.gone


def test_advance_samples_from_the_request_stream():
    """One sampled step on a toy canvas draws with the given generator exactly as
    `decode.choose_unmask` does (the reference's code), and greedy ignores the stream."""
    from spiffy_plugin.decode import choose_unmask, step_distribution
    from spiffy_plugin.engines.sglang import SpiffyConfig
    from spiffy_plugin.engines.sglang_drafts import advance
    from spiffy_plugin.graph import DraftGraph, Node

    graph = DraftGraph((Node.of([(0, 0)], 1),), (1,), 4, 8, "vanilla-1")
    cfg = SpiffyConfig(graph, "-", 1, rule_params("vanilla-1"), 2, None, (2,))
    logits = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    sampled = request_params(cfg.params, 1.0, 0.9, TOP_K_ALL)
    ids = torch.tensor([5, 2, 2, 2])
    prompt = torch.tensor([True, False, False, False])
    out = advance(ids, logits, [], None, CanvasState(prompt), cfg, params=sampled,
                  generator=torch.Generator().manual_seed(9))
    assert not out.done
    masked = logits.clone()
    masked[:, [2]] = float("-inf")
    want = torch.tensor([5, 2, 2, 2])
    pos, tok = choose_unmask(step_distribution(masked, sampled), want == 2, sampled,
                             torch.Generator().manual_seed(9))
    want[pos] = tok
    assert torch.equal(ids, want)
    greedy = torch.tensor([5, 2, 2, 2])
    advance(greedy, logits, [], None, CanvasState(prompt), cfg)
    g2 = torch.tensor([5, 2, 2, 2])
    advance(g2, logits, [], None, CanvasState(prompt), cfg, generator=torch.Generator())
    assert torch.equal(greedy, g2)
