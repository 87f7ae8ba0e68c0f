"""`benchmarks/bench/sampling_stats.py` and `gpu_sampling.py compare`, without an engine: the
chi-square homogeneity tests that decide whether a speculative engine mode samples plain
decoding's distribution at T > 0. Synthetic completions (seeded torch draws): two runs of one
distribution pass; a sampler that moves 6 % of one position's mass onto the drafter's token
fails; so does one whose later positions ignore the residual."""

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("scipy")

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"


@pytest.fixture(scope="module")
def mods():
    saved = list(sys.path)
    sys.path.insert(0, str(BENCH))
    try:
        import gpu_sampling
        from bench import sampling_stats

        yield sampling_stats, gpu_sampling
    finally:
        sys.path[:] = saved


PROBS = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])  # one position's distribution


def completions(n: int, seed: int, length: int = 3, bias: float = 0.0, at: int = 1):
    """n completions of `length` tokens; position `at` moves `bias` of its mass onto token 5
    (a biased sampler's favourite draft) from token 0."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(length):
        p = PROBS.clone()
        if k == at and bias:
            p[0] -= bias
            p[5] += bias
        out.append(torch.multinomial(p, n, replacement=True, generator=g))
    return [list(map(int, t)) for t in torch.stack(out, 1)]


def test_position_table_pools_rare_tokens(mods):
    st, _ = mods
    a = [[1, 7], [1, 8], [2, 7]]
    b = [[1, 7], [3, 7], [1]]
    assert st.position_table(a, b, 0, min_count=2) == [[2, 1], [2, 1]]  # token 1, rest (2, 3)
    assert st.position_table(a, b, 0, min_count=1) == [[2, 1, 0], [2, 0, 1]]  # 1, 2, 3
    assert st.position_table(a, b, 1, min_count=3) == [[2, 1], [2, 0]]  # 7, rest (8); [1] short


def test_same_distribution_passes_and_a_biased_sampler_fails(mods):
    st, _ = mods
    plain = {"0": completions(2000, 1), "1": completions(2000, 2)}
    same = {"0": completions(2000, 3), "1": completions(2000, 4)}
    biased = {"0": completions(2000, 3, bias=0.06), "1": completions(2000, 4, bias=0.06)}
    ok = st.verdict(st.homogeneity_tests(same, plain, [0, 1, 2]))
    assert ok["passed"] and ok["tests"] == 6
    bad = st.verdict(st.homogeneity_tests(biased, plain, [0, 1, 2]))
    assert not bad["passed"] and bad["worst"]["position"] == 1


def test_one_token_everywhere_is_no_evidence(mods):
    st, _ = mods
    t = st.homogeneity_tests({"0": [[5, 5]] * 50}, {"0": [[5, 5]] * 40}, [0, 1])
    assert [x["p"] for x in t] == [1.0, 1.0]
    with pytest.raises(ValueError, match="no tests"):
        st.verdict(st.homogeneity_tests({"0": [[1]]}, {"1": [[1]]}, [0]))


def _write(path: Path, prompts: dict, **kw) -> str:
    doc = {"kind": "engine-sampling", "temperature": 1.0, "max_tokens": 3, "target": "t",
           "prompts": prompts, **kw}
    path.write_text(json.dumps(doc))
    return str(path)


def test_compare_command_verdicts(mods, tmp_path, capsys):
    _, gs = mods
    plain = _write(tmp_path / "plain.json", {"0": completions(2000, 1)}, mode="plain")
    tree = _write(tmp_path / "tree.json", {"0": completions(2000, 2)}, mode="tree")
    bad = _write(tmp_path / "bad.json", {"0": completions(2000, 2, bias=0.06, at=2)},
                 mode="tree")
    gs.main(["compare", tree, plain, "--out", str(tmp_path / "v.json")])
    assert "same distribution" in capsys.readouterr().out
    assert json.loads((tmp_path / "v.json").read_text())["passed"] is True
    with pytest.raises(SystemExit) as e:
        gs.main(["compare", bad, plain])
    assert e.value.code == 1 and "DIFFERENT" in capsys.readouterr().out
    other = _write(tmp_path / "t0.json", {"0": completions(10, 1)}, mode="tree",
                   temperature=0.5)
    with pytest.raises(SystemExit, match="temperature"):
        gs.main(["compare", other, plain])


def test_runs_that_replay_one_random_stream_are_not_independent(mods, tmp_path, capsys):
    """Two runs of one distribution where 30 % of the second run's completions repeat the
    first's in order (a shared seed): the chi-square tests pass, `coincidences` does not, and
    `compare` exits 2; independent runs of the same distribution are independent."""
    st, gs = mods
    first, other = completions(2000, 1), completions(2000, 2)
    replay = [u if i % 10 < 3 else v for i, (u, v) in enumerate(zip(first, other))]
    same = st.coincidences({"0": replay}, {"0": first})
    assert not same["independent"]
    row = same["prompts"][0]
    assert row["equal_in_order"] > 600 and 20 < row["expected"] < 60
    assert st.coincidences({"0": other}, {"0": first})["independent"]
    a = _write(tmp_path / "a.json", {"0": first}, mode="plain")
    b = _write(tmp_path / "b.json", {"0": replay}, mode="plain")
    with pytest.raises(SystemExit) as e:
        gs.main(["compare", b, a])
    out = capsys.readouterr().out
    assert e.value.code == 2 and "same distribution" in out and "NOT INDEPENDENT" in out


def test_calibrate_halves_of_one_run(mods, tmp_path, capsys):
    """Random halves of one run's completions are one distribution: (almost) no split fails,
    and the median smallest p-value is near the uniform one's."""
    st, gs = mods
    one = {"0": completions(2000, 1), "1": completions(2000, 2)}
    cal = st.split_calibration(one, [0, 1, 2], splits=20)
    assert cal["failed"] <= 1 and cal["tests"] == 6 and cal["median_min_p"] > 0.01
    path = _write(tmp_path / "one.json", one, mode="plain")
    gs.main(["calibrate", path, "--splits", "10", "--out", str(tmp_path / "c.json")])
    assert "of 10 random halvings fail" in capsys.readouterr().out
    assert json.loads((tmp_path / "c.json").read_text())["splits"] == 10


def test_run_refuses_greedy(mods, capsys):
    _, gs = mods
    with pytest.raises(SystemExit):
        gs.parse_args(["run", "--engine", "sglang", "--mode", "tree", "--temperature", "0",
                       "--out", "x.json"])
    assert "--temperature must be > 0" in capsys.readouterr().err
