"""The `dflash` CLI on the bundled code-target fixture (real weights, real tokenizer)."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_plugin.cli import main

ROOT = Path(__file__).resolve().parents[2]
TARGET = ROOT / "examples" / "fixtures" / "code-target"


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("draft")
    assert main(["init-draft", "--target", str(TARGET), "--out", str(out), "--layers", "1",
                 "--block-size", "8"]) == 0
    return out


def test_generate_json_is_lossless(drafter_dir, capsys):
    prompt = "def fibonacci(n):"
    assert main(["generate", "--target", str(TARGET), "--draft", str(drafter_dir),
                 "--prompt", prompt, "--max-new-tokens", "24", "--json", "--baseline"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["baseline"]["token_identical"] is True
    assert report["new_tokens"] <= 24 and report["tau"] >= 1.0
    tok = AutoTokenizer.from_pretrained(TARGET)
    model = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    ids = tok(prompt, return_tensors="pt").input_ids
    ref = model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=1)
    assert report["completion"] == tok.decode(ref[0, ids.shape[1]:])


def test_generate_tree_json_is_lossless(capsys):
    """--tree-budget with the bundled trained drafter: token-identical, tau and tree metrics."""
    draft = ROOT / "examples" / "fixtures" / "code-target-dflash-b16"
    assert main(["generate", "--target", str(TARGET), "--draft", str(draft), "--prompt",
                 "def fibonacci(n):", "--max-new-tokens", "48", "--json", "--baseline",
                 "--tree-budget", "32", "--tree-topk", "4"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["baseline"]["token_identical"] is True
    assert report["tau"] > 1.0
    assert report["tree"]["nodes_per_round"] == 32.0
    assert sum(report["tree"]["accepted_depths"].values()) == report["rounds"]


def test_generate_text_output_and_sampling(drafter_dir, capsys):
    prompt = "import numpy as np"
    args = ["generate", "--target", str(TARGET), "--draft", str(drafter_dir),
            "--prompt", prompt, "--max-new-tokens", "8",
            "--temperature", "0.8", "--top-p", "0.9", "--seed", "1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert main(args + ["--json"]) == 0  # the same seed: the same sample, as JSON
    rep = json.loads(capsys.readouterr().out)
    assert 1 <= rep["new_tokens"] <= 8 and rep["rounds"] >= 1 and rep["block_size"] == 8
    assert len(rep["per_position_acceptance"]) == 7  # block 8: positions 1..7 drafted
    assert out.startswith(prompt + rep["completion"] + "\n" + "-" * 60 + "\n")
    assert (f"new tokens {rep['new_tokens']}  rounds {rep['rounds']}  tau {rep['tau']:.2f}  "
            "block 8\n") in out
    assert ("per-position acceptance: "
            + " ".join(f"{x:.2f}" for x in rep["per_position_acceptance"]) + "\n") in out


@pytest.mark.parametrize("args,message", [
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "top_p"),
    (["--block-size", "1"], "block_size"),
    (["--prompt", ""], "--prompt"),
    (["--tree-budget", "-1"], "--tree-budget"),
    (["--tree-budget", "8", "--tree-topk", "0"], "tree_topk"),
])
def test_generate_bad_input(drafter_dir, capsys, args, message):
    base = ["generate", "--target", str(TARGET), "--draft", str(drafter_dir),
            "--prompt", "x = 1", "--max-new-tokens", "4"]
    assert main(base + args) == 2
    assert message in capsys.readouterr().err


def test_mismatched_drafter_is_refused(tmp_path, capsys):
    assert main(["init-draft", "--target", str(TARGET), "--out", str(tmp_path),
                 "--layers", "1", "--block-size", "8"]) == 0
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_target_layers"] = 36
    cfg["dflash_config"]["target_layer_ids"] = [18]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["generate", "--target", str(TARGET), "--draft", str(tmp_path),
                 "--prompt", "x = 1"]) == 2
    assert "num_target_layers" in capsys.readouterr().err
