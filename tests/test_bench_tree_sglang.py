"""`benchmarks/gpu_tree_sglang.py` without an engine (SGLang is not imported): the mode names it
accepts (any node budget), the engine keywords of each mode (DFLASH_TREE's width = budget + 1,
the dtype reaching SGLang, graphs without prefill graphs), and the report's greedy identity over
the shorter of two outputs with the first differing position.
"""

import importlib.util
import json

import pytest

from tests.test_bench_tp import BENCH


@pytest.fixture(scope="module")
def bench():
    path = BENCH / "gpu_tree_sglang.py"
    spec = importlib.util.spec_from_file_location("_bench_tree_sglang", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("text", ["plain", "dflash", "tree1", "tree15", "tree256"])
def test_modes_accepted(bench, text):
    assert bench.mode(text) == text


@pytest.mark.parametrize("text", ["tree", "tree0", "tree-4", "treex", "eagle", ""])
def test_modes_refused_with_the_field(bench, text):
    with pytest.raises(Exception, match="mode: plain, dflash or treeN"):
        bench.mode(text)


def test_engine_kwargs_per_mode(bench):
    args = bench.parse_args(["run", "--mode", "tree15", "--topk", "1", "--dtype", "float32"])
    kw = bench.engine_kwargs(args, args.mode)
    assert (kw["speculative_algorithm"], kw["speculative_num_draft_tokens"],
            kw["speculative_eagle_topk"], kw["dtype"]) == ("DFLASH_TREE", 16, 1, "float32")
    assert kw["cuda_graph_backend_prefill"] == "disabled" and "disable_cuda_graph" not in kw
    eager = bench.parse_args(["run", "--mode", "plain", "--eager"])
    kw = bench.engine_kwargs(eager, "plain")
    assert kw["disable_cuda_graph"] and "speculative_algorithm" not in kw
    assert kw["dtype"] == "bfloat16"


def _doc(mode, rows):
    return {"mode": mode, "rows": [{"concurrency": c, "tokens_per_s": tps, "wall_s": 1.0,
                                    "tau": tau, "tokens": toks} for c, tps, tau, toks in rows]}


def test_report_identity_and_first_difference(bench, tmp_path, capsys):
    plain = [[1, 2, 3, 4], [5, 6, 7, 8]]
    docs = {"plain": _doc("plain", [(1, 100.0, None, plain)]),
            "tree32": _doc("tree32", [(1, 50.0, 5.0, [[1, 2, 9, 4], [5, 6, 7, 8]])]),
            "tree32-short": _doc("tree32", [(1, 80.0, 4.0, [[1, 2], [5, 6]])])}
    for name, doc in docs.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
    (tmp_path / "other.json").write_text("[1, 2]")  # not a run: skipped
    bench.cmd_report(bench.parse_args(["report", "--out", str(tmp_path)]))
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in capsys.readouterr().out.splitlines()[2:]}
    assert list(rows) == ["plain", "tree32-short", "tree32"]
    assert rows["tree32"] == ["1", "50", "0.50", "5.00", "1/2", "2"]
    assert rows["tree32-short"][4:] == ["2/2", "-"]  # equal over the 2 tokens it has
