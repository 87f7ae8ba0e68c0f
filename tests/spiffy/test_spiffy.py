"""Spiffy on the real code-dllm fixture: lossless against vanilla / threshold decoding."""

import itertools
import json
import random

import pytest

from spiffy_plugin.calibrate import calibrate
from spiffy_plugin.decode import DecodeParams, generate
from spiffy_plugin.errors import ConfigError
from spiffy_plugin.graph import (
    DraftGraph,
    Node,
    accepted_depth,
    is_parent,
    load_graph,
    select_by_depth,
    select_graph,
)
from spiffy_plugin.spiffy import spiffy_generate
from tests.spiffy.test_runtime import dllm  # noqa: F401 (module fixture)

CALIB = ["def merge_sort(items):", "class Node:\n    def __init__(self, value):",
         "import os\nimport sys\n\n\ndef main(argv):"]
EVAL = ["def fibonacci(n):",  # 9 tokens: ends mid-block
        "class Stack:\n    \"\"\"A stack.\"\"\"\n\n    def push(self, item):"]  # 16: a boundary


def test_parent_relation_and_selection_on_random_graphs():
    rng = random.Random(0)
    for _ in range(20):
        nodes = {}
        for _ in range(40):
            depth = rng.randint(1, 3)
            pairs = {(rng.randint(0, 3), rng.randint(0, 2)) for _ in range(depth)}
            if len(pairs) == depth:
                nodes[Node.of(pairs, depth)] = rng.randint(1, 50)
        for a, b in itertools.product(nodes, nodes):
            want = b.depth == a.depth + 1 and set(a.pairs) < set(b.pairs)
            assert is_parent(a, b) == want
        reachable = {n for n in nodes if n.depth == 1}  # closure under "has a parent in it"
        while grown := {n for n in nodes if n not in reachable
                        and any(is_parent(p, n) for p in reachable)}:
            reachable |= grown
        chosen = select_graph(nodes, 6)
        assert len(chosen) == min(6, len(reachable)) and len(set(chosen)) == len(chosen)
        everything = select_graph(nodes, len(nodes) + 1)  # a budget it cannot fill
        assert len(everything) == len(reachable) and set(everything) == reachable
        for n in chosen:
            assert n.depth == 1 or any(is_parent(p, n) for p in chosen)
        g = DraftGraph(tuple(chosen), tuple(nodes[n] for n in chosen), 16, 100, "vanilla-1")
        assert g.children(None) == [k for k, n in enumerate(chosen) if n.depth == 1]
        below = [c for n in chosen for c in g.children(n)]
        assert set(g.children(None) + below) == set(range(len(chosen)))  # all reachable
        for n in chosen:
            assert g.children(n) == [c for c, m in enumerate(chosen) if is_parent(n, m)]


@pytest.fixture(scope="module")
def graphs(dllm):  # noqa: F811
    model, tok = dllm
    prompts = [tok(p).input_ids for p in CALIB]
    out = {d: calibrate(model, prompts, d, max_new_tokens=32) for d in (3, 8)}
    out["acc8"] = calibrate(model, prompts, 8, max_new_tokens=32,
                            selection="accumulated-frequency")
    return out


def test_calibration_is_deterministic_and_roundtrips(dllm, graphs, tmp_path):  # noqa: F811
    model, tok = dllm
    again = calibrate(model, [tok(p).input_ids for p in CALIB], 8, max_new_tokens=32)
    assert again.to_json() == graphs[8].to_json()
    graphs[8].save(tmp_path / "g.json")
    assert load_graph(tmp_path / "g.json") == graphs[8]
    assert len(graphs[8].nodes) == 8 and graphs[8].rule == "vanilla-1"
    assert graphs[8].selection == "expected-depth"
    assert load_graph(tmp_path / "g.json").selection == "expected-depth"
    graphs["acc8"].save(tmp_path / "a.json")
    assert load_graph(tmp_path / "a.json") == graphs["acc8"]


def test_expected_depth_selection_is_the_greedy_of_its_objective():
    """Each added node is the frontier node of largest marginal gain in total accepted depth,
    computed naively by re-simulating every chain; the graph stays connected."""
    rng = random.Random(1)
    for _ in range(10):
        chains = []
        for _ in range(60):
            pairs, chain = [], []
            for k in range(1, rng.randint(1, 4) + 1):
                pairs.append((rng.randint(0, k), rng.randint(0, 1)))
                if len(set(pairs)) < len(pairs):
                    break
                chain.append(Node.of(pairs, k))
            chains.append(chain)
        chosen = select_by_depth(chains, 7)

        def total(nodes, chains=chains):
            return sum(accepted_depth(c, set(nodes)) for c in chains)

        for k, n in enumerate(chosen):
            assert n.depth == 1 or any(is_parent(p, n) for p in chosen[:k])
            frontier = {c[accepted_depth(c, set(chosen[:k]))] for c in chains
                        if accepted_depth(c, set(chosen[:k])) < len(c)}
            best = max(total(chosen[:k] + [m]) for m in frontier)
            assert total(chosen[:k + 1]) == best


@pytest.mark.parametrize("budget,keep", [(3, None), (8, None), (8, 4), ("acc8", None)])
@pytest.mark.parametrize("prompt", EVAL)
def test_greedy_lossless_and_fewer_forwards(dllm, graphs, budget, keep, prompt):  # noqa: F811
    model, tok = dllm
    ids = tok(prompt).input_ids
    vanilla = generate(model, ids, DecodeParams(), 40)
    fast = spiffy_generate(model, ids, graphs[budget], DecodeParams(), 40, keep=keep)
    assert fast.tokens == vanilla.tokens
    assert fast.steps == vanilla.steps
    assert fast.nfe < vanilla.nfe


def test_threshold_and_sampling_lossless(dllm, graphs):  # noqa: F811
    model, tok = dllm
    ids = tok(EVAL[0]).input_ids
    for params in (DecodeParams(threshold=0.9), DecodeParams(temperature=0.7, top_p=0.9, seed=5)):
        assert spiffy_generate(model, ids, graphs[8], params, 32).tokens == \
            generate(model, ids, params, 32).tokens


def test_bad_graph_input(dllm, graphs, tmp_path):  # noqa: F811
    model, tok = dllm
    ids = tok(EVAL[0]).input_ids
    g = graphs[3]
    with pytest.raises(ConfigError, match="keep"):
        spiffy_generate(model, ids, g, DecodeParams(), 8, keep=4)  # D* > D
    with pytest.raises(ConfigError, match="budget"):
        select_graph({Node.of([(0, 0)], 1): 1}, 0)
    for field, value in (("block_size", 32), ("vocab_size", 999)):
        raw = {**g.to_json(), field: value}
        (tmp_path / "g.json").write_text(json.dumps(raw))
        with pytest.raises(ConfigError, match=f"graph.{field}"):
            spiffy_generate(model, ids, load_graph(tmp_path / "g.json"), DecodeParams(), 8)
    (tmp_path / "g.json").write_text(json.dumps({**g.to_json(), "version": 99}))
    with pytest.raises(ConfigError, match="version"):
        load_graph(tmp_path / "g.json")


def test_sampled_distribution_matches_vanilla(dllm, graphs):  # noqa: F811
    """Independent seeds: Spiffy's samples and vanilla's follow one distribution (chi-square on
    the first generated tokens); a different temperature is detected by the same test."""
    from scipy.stats import chi2_contingency

    model, tok = dllm
    ids = tok("import os\n\n\ndef").input_ids
    n, new = 100, 2

    def first_tokens(fn, temperature, seed0):
        params = [DecodeParams(temperature=temperature, seed=seed0 + i) for i in range(n)]
        return [tuple(fn(p).tokens[:2]) for p in params]

    vanilla = first_tokens(lambda p: generate(model, ids, p, new), 1.0, 0)
    spiffy = first_tokens(lambda p: spiffy_generate(model, ids, graphs[8], p, new), 1.0, 10_000)
    colder = first_tokens(lambda p: generate(model, ids, p, new), 0.3, 20_000)

    def pvalue(a, b):
        common = [k for k in set(a) | set(b) if a.count(k) + b.count(k) >= 10]
        rows = [[a.count(k) for k in common] + [sum(x not in common for x in a)],
                [b.count(k) for k in common] + [sum(x not in common for x in b)]]
        rows = [r for r in zip(*rows) if sum(r) > 0]
        return chi2_contingency(list(zip(*rows))).pvalue

    assert pvalue(vanilla, spiffy) > 1e-3
    assert pvalue(vanilla, colder) < 1e-3
