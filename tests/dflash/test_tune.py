"""`dflash tune`'s decision and configs from hand-made measurement tables (no engine)."""

import json

import pytest

from dflash_plugin.cli import build_parser
from dflash_plugin.errors import ConfigError
from dflash_plugin.tune import (
    Cell,
    acceptance,
    batch_size_table,
    best_k,
    choose,
    model_k,
    parse_int_list,
    report,
    request_from_args,
    round_ms,
    sglang_args,
    validate_candidates,
    vllm_fixed_config,
    vllm_table_config,
)

DRAFT = "examples/fixtures/code-target-dflash-b16"
TARGET = "examples/fixtures/code-target"
PROMPTS = "examples/fixtures/dev-prompts.jsonl"


def table(rows: dict[int, dict[int, float]]) -> list[Cell]:
    """{concurrency: {k: tokens/s}} -> cells (tau 1 + 0.4 k for k > 0)."""
    return [Cell(k=k, concurrency=c, tokens_per_s=t, tau=None if k == 0 else 1 + 0.4 * k)
            for c, ks in rows.items() for k, t in ks.items()]


# The H200 shape of the issue: speculation pays at 1 request, less at 8, loses at 32.
ISSUE = table({1: {0: 445, 7: 1100, 15: 1215}, 8: {0: 4136, 7: 5200, 15: 4960},
               32: {0: 10086, 7: 9900, 15: 9885}})


@pytest.mark.parametrize("row,min_gain,expected", [
    ({0: 100, 7: 150, 15: 200}, 0.02, 15),  # longest draft pays most
    ({0: 100, 7: 150, 15: 140}, 0.02, 7),  # a middle k
    ({0: 100, 7: 99, 15: 90}, 0.02, 0),  # speculation loses: plain
    ({0: 100, 7: 101, 15: 90}, 0.02, 0),  # within the margin: plain
    ({0: 100, 7: 101, 15: 90}, 0.0, 7),  # no margin
    ({0: 100, 7: 150, 15: 150}, 0.02, 7),  # tie: the smaller k
    ({7: 90, 15: 80}, 0.02, 7),  # no plain cell: the best measured
    ({0: 100}, 0.02, 0),
])
def test_best_k(row, min_gain, expected):
    cells = {k: Cell(k=k, concurrency=4, tokens_per_s=t) for k, t in row.items()}
    assert best_k(cells, min_gain) == expected


def test_choose_per_concurrency():
    assert choose(ISSUE) == {1: 15, 8: 7, 32: 0}


@pytest.mark.parametrize("choice,max_seqs,expected", [
    ({1: 15, 8: 7, 32: 0}, 64, [[1, 2, 15], [3, 16, 7], [17, 64, 0]]),
    ({1: 15, 4: 15, 8: 7, 16: 7, 32: 0, 64: 0}, None, [[1, 5, 15], [6, 22, 7], [23, 64, 0]]),
    ({1: 15}, None, [[1, 1, 15]]),
    ({1: 0, 2: 3, 3: 0}, 8, [[1, 1, 0], [2, 2, 3], [3, 8, 0]]),
    ({2: 7, 64: 0}, 16, [[1, 11, 7], [12, 64, 0]]),  # first range starts at 1 (vLLM requires)
])
def test_batch_size_table(choice, max_seqs, expected):
    rows = batch_size_table(choice, max_seqs)
    assert rows == expected
    for c, k in choice.items():  # every measured concurrency gets its own choice
        assert [r[2] for r in rows if r[0] <= c <= r[1]] == [k]


def test_vllm_configs():
    assert vllm_fixed_config(DRAFT, 0) is None  # vLLM cannot express k = 0: no config
    assert vllm_fixed_config(DRAFT, 7) == {"method": "dflash", "model": DRAFT,
                                           "num_speculative_tokens": 7}
    assert vllm_table_config(DRAFT, {1: 0, 8: 0}) is None
    assert vllm_table_config(DRAFT, {1: 7, 8: 7}) == vllm_fixed_config(DRAFT, 7)  # no table
    assert vllm_table_config(DRAFT, {1: 15, 8: 7, 32: 0}, 64) == {
        "method": "dflash", "model": DRAFT, "num_speculative_tokens": 15,
        "num_speculative_tokens_per_batch_size": [[1, 2, 15], [3, 16, 7], [17, 64, 0]]}


def test_sglang_args():
    assert sglang_args(DRAFT, 0) == []
    assert sglang_args(DRAFT, 7) == ["--speculative-algorithm", "DFLASH",
                                     "--speculative-draft-model-path", DRAFT,
                                     "--speculative-num-draft-tokens", "8"]
    assert sglang_args(DRAFT, 15, 64)[-2:] == ["--max-running-requests", "64"]
    assert "--max-running-requests" not in sglang_args(DRAFT, 15, 48)


@pytest.mark.parametrize("target,k,fixed", [
    (None, 0, None),  # default: the largest measured concurrency
    (1, 15, {"method": "dflash", "model": DRAFT, "num_speculative_tokens": 15}),
    (12, 7, {"method": "dflash", "model": DRAFT, "num_speculative_tokens": 7}),  # 8 <= 12 < 32
    (1000, 0, None),
])
def test_report_vllm(target, k, fixed):
    doc = report(ISSUE, engine="vllm", draft=DRAFT, target_concurrency=target, max_num_seqs=32)
    assert doc["target_k"] == k
    assert doc["vllm"]["speculative_config"] == fixed
    assert doc["vllm"]["speculative_config_table"]["num_speculative_tokens_per_batch_size"] == [
        [1, 2, 15], [3, 16, 7], [17, 32, 0]]
    assert {c: v["k"] for c, v in doc["choice"].items()} == {"1": 15, "8": 7, "32": 0}
    assert doc["choice"]["1"]["vs_plain"] == pytest.approx(1215 / 445)
    assert doc["choice"]["32"]["vs_plain"] == 1.0
    json.dumps(doc)  # serialisable
    assert len(doc["cells"]) == 9


def test_report_sglang():
    doc = report(ISSUE, engine="sglang", draft=DRAFT, target_concurrency=8)
    assert doc["sglang"]["args"][-1] == "8"  # k = 7 -> verify window 8
    assert doc["sglang"]["per_concurrency"]["32"] == []
    assert "vllm" not in doc


def test_round_ms_and_model_k():
    # c = 4: plain 400 tok/s -> 10 ms a step; k = 3 (tau 2.2) 600 tok/s -> 14.67 ms a round
    s = [0.6, 0.4, 0.2]
    row = {0: Cell(0, 4, 400.0), 3: Cell(3, 4, 600.0, tau=2.2, survival=s)}
    assert round_ms(row) == pytest.approx({1: 10.0, 4: 1e3 * 4 * 2.2 / 600})
    assert model_k(row) == 3  # E(4) / T(4) = 2.2 / 14.67 > 1 / 10
    slow = {0: Cell(0, 4, 400.0), 3: Cell(3, 4, 300.0, tau=2.2, survival=s)}
    assert model_k(slow) == 0
    assert model_k({0: Cell(0, 4, 400.0)}) is None  # no acceptance measured


def test_acceptance_from_counters():
    before = {"num_drafts": 10, "num_accepted_tokens": 20, "accepted_per_pos": [8, 7, 5]}
    after = {"num_drafts": 20, "num_accepted_tokens": 35, "accepted_per_pos": [16, 13, 8]}
    got = acceptance(before, after)
    assert got["rounds"] == 10 and got["tau"] == pytest.approx(2.5)
    assert got["survival"] == pytest.approx([0.8, 0.6, 0.3])
    assert acceptance(after, after) == {"tau": None, "survival": [], "rounds": 0}
    assert acceptance({}, after)["survival"] == pytest.approx([0.8, 0.65, 0.4])


@pytest.mark.parametrize("fn,message", [
    (lambda: parse_int_list("1,x", "--concurrency", 1), "--concurrency: must be comma-separated"),
    (lambda: parse_int_list("0,4", "--concurrency", 1), "--concurrency: values must be >= 1, "
     "got [0]"),
    (lambda: parse_int_list("", "--concurrency", 1), "needs at least one value"),
    (lambda: validate_candidates([0, 16], 16), "--candidates: values must be in [0, 15] "
     "(drafter block size 16), got [16]"),
    (lambda: validate_candidates([-1], 16), "got [-1]"),
])
def test_bad_values(fn, message):
    with pytest.raises(ConfigError, match=None) as err:
        fn()
    assert message in str(err.value)


def _args(*extra):
    return build_parser().parse_args(["tune", "--engine", "vllm", "--target", TARGET, "--draft",
                                      DRAFT, "--prompts", PROMPTS, *extra])


def test_request_defaults():
    req = request_from_args(_args())
    assert req.block_size == 16 and req.candidates == [0, 3, 7, 15]
    assert req.concurrency == [1, 4, 8, 16, 32, 64] and len(req.prompts) > 0


@pytest.mark.parametrize("extra,message", [
    (("--engine", "tgi"), "--engine: must be vllm or sglang, got 'tgi'"),
    (("--candidates", "0,31"), "--candidates: values must be in [0, 15]"),
    (("--concurrency", "1,-4"), "--concurrency: values must be in [1, 4096], got [-4]"),
    (("--max-new-tokens", "0"), "--max-new-tokens: must be >= 1, got 0"),
    (("--max-new-tokens", "4000"), "--max-new-tokens: must leave room"),
    (("--waves", "0"), "--waves: must be >= 1"),
    (("--temperature", "-1"), "--temperature: must be in [0, 2]"),
    (("--min-gain", "1.5"), "--min-gain: must be in [0, 1)"),
    (("--target-concurrency", "0"), "--target-concurrency: must be >= 1"),
    (("--engine-args", "[1]"), "--engine-args: must be a JSON object"),
    (("--engine-args", "{x"), "--engine-args: is not valid JSON"),
    (("--draft", TARGET), "--draft: "),  # a target folder has no block_size
    (("--target", "/nonexistent"), "--target: no config.json"),
    (("--prompts", "/nonexistent.jsonl"), "prompts: file not found"),
])
def test_request_bad_args(extra, message):
    with pytest.raises(ConfigError) as err:
        request_from_args(_args(*extra))
    assert message in str(err.value)


def test_cli_bad_arg_exits_2_before_any_engine(capsys):
    from dflash_plugin.cli import main

    assert main(["tune", "--engine", "vllm", "--target", TARGET, "--draft", DRAFT, "--prompts",
                 PROMPTS, "--candidates", "0,16"]) == 2
    assert "--candidates: values must be in [0, 15]" in capsys.readouterr().err


def test_prompt_ids_takes_prompts_not_a_path():
    """The engines' tune (and the SGLang adaptive harness) tokenise prompt strings; a path
    given instead (a str, whose items are its characters, as the harness did until
    2026-12-03) is a clear error, not a run on one-character prompts."""
    from pathlib import Path

    from dflash_plugin.engines.vllm_tune import prompt_ids
    from dflash_plugin.training.data import load_prompts_jsonl

    fix = Path(__file__).resolve().parents[2] / "examples" / "fixtures"
    path = fix / "dev-prompts.jsonl"
    with pytest.raises(ConfigError, match="prompts.*list of prompt strings.*str"):
        prompt_ids(str(fix / "code-target"), str(path), 100)
    prompts = load_prompts_jsonl(path)[:3]
    ids = prompt_ids(str(fix / "code-target"), prompts, 100)
    assert len(ids) == 3 and all(1 < len(i) <= 100 for i in ids)


def test_measure_cells_serves_again_until_min_seconds(monkeypatch):
    """A cell's requests are served again until the cell has run min_seconds (a fake clock:
    each serve takes 0.4 s); tokens, requests and the window add up; min_seconds 0: once."""
    from dflash_plugin import tune

    clock = [0.0]
    monkeypatch.setattr(tune.time, "perf_counter", lambda: clock[0])
    served = []

    def serve(ids, new_tokens, c):
        served.append((len(ids), new_tokens, c))
        clock[0] += 0.4
        return [tune.Finished(token_ids=[1] * new_tokens, latency_s=0.4) for _ in ids]

    probe = lambda: (lambda done: {"tau": float(len(done))})  # noqa: E731
    cells = tune.measure_cells(serve, probe, 15, [[1], [2]], [2], max_new_tokens=4, waves=2,
                               warmup_tokens=1, min_seconds=1.0, log=lambda m: None)
    (cell,) = cells
    assert served == [(4, 1, 2)] + [(4, 4, 2)] * 3  # warm-up, then 3 x 0.4 s >= 1 s
    assert cell.requests == 12 and cell.tau == 12.0
    assert cell.wall_s == pytest.approx(1.2) and cell.tokens_per_s == pytest.approx(48 / 1.2)
    served.clear()
    (once,) = tune.measure_cells(serve, probe, 15, [[1]], [2], max_new_tokens=4,
                                 warmup_tokens=1, log=lambda m: None)  # 16 waves by default
    assert served == [(32, 1, 2), (32, 4, 2)] and once.requests == 32
