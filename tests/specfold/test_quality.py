"""Task-quality metrics as tables of hand-made strings: the cut at the last complete line, the
prefix-tolerant parse check, first lines, a bootstrap CI with a known answer, and the judge's
log-likelihood against a token-by-token computation with the code-target fixture."""

from pathlib import Path

import pytest
import torch

from specfold_plugin.quality import (
    bootstrap_ci,
    completion_parses,
    cut_at_last_line,
    first_line,
    judge_loglik,
    judge_logprobs,
    parse_rate,
    parse_status,
)

TARGET = Path(__file__).resolve().parents[2] / "examples" / "fixtures" / "code-target"


@pytest.mark.parametrize("completion,ended,cut", [
    ("\n    return x\n    y = (", False, "\n    return x"),
    ("abc", False, ""),
    ("abc", True, "abc"),
    ("a\nb\n", False, "a\nb"),
    ("", False, ""),
])
def test_cut_at_last_line(completion, ended, cut):
    assert cut_at_last_line(completion, ended) == cut


@pytest.mark.parametrize("source,status", [
    ("x = 1\n", "ok"),
    ("def f(x):\n    return x", "ok"),
    ("def f(x):", "incomplete"),  # a block that needs a body
    ("x = [1,\n     2,", "incomplete"),  # an open bracket
    ('def f():\n    """Doc\n    more', "incomplete"),  # inside a docstring
    ("if x:\n    a\nelse:", "incomplete"),
    ("x = )", "error"),
    ("x = 1\n  y = 2", "error"),  # unexpected indent
    ("def f(:\n    pass\nx = (", "error"),  # an error before an open bracket
    ("x = (1 2", "error"),
])
def test_parse_status(source, status):
    assert parse_status(source) == status


@pytest.mark.parametrize("prompt,completion,ended,parses", [
    # prompt mid-function; the unfinished last line is cut away
    ("def f(x):\n    y = x + 1", "\n    return y\n\n\ndef g(", False, True),
    ("def f(x):\n    y = x + 1", "\n    return y)\n    z", False, False),  # ')' unmatched
    ("def f(x):\n    y = x + 1", "\n  return y\n", False, False),  # dedent to no level
    # prompt inside a docstring: text stays a string until the quotes close
    ('def f():\n    """Return', " one.\n    ) ( not code\n", False, True),
    ('def f():\n    """Return', ' one."""\n    return 1 +\n', False, False),
    # the broken partial last line is cut unless the completion ended (EOS)
    ("x = 1", "\ny = 2\nz = )", False, True),
    ("x = 1", "\ny = 2\nz = )", True, False),
])
def test_completion_parses(prompt, completion, ended, parses):
    assert completion_parses(prompt, completion, ended) is parses


def test_parse_rate():
    assert parse_rate(["x = 1"] * 4, ["\ny = 2\n", "\ny = )\n", "\n", "\nz = [\n"]) == 0.75
    with pytest.raises(ValueError, match="as many prompts"):
        parse_rate(["x"], [])


@pytest.mark.parametrize("completion,line", [
    ("\n    return G\n", "    return G"),
    ("(x)\nnext", "(x)"),
    ("\n\n   \n\ndef f():  \n", "def f():"),
    ("\n \n", ""),
])
def test_first_line(completion, line):
    assert first_line(completion) == line


def test_bootstrap_two_points():
    # n = 2 from {0, 1}: the resampled mean is 0 / 0.5 / 1 with probability 1/4, 1/2, 1/4, so
    # the 2.5 % and 97.5 % order statistics of 2000 resamples are 0 and 1
    assert bootstrap_ci([0.0, 1.0], 2000, 0.95, 0) == (0.5, 0.0, 1.0)


def test_bootstrap_constant_and_seeded():
    assert bootstrap_ci([0.25] * 7) == (0.25, 0.25, 0.25)
    vals = [float(i % 3) for i in range(20)]
    assert bootstrap_ci(vals, seed=3) == bootstrap_ci(vals, seed=3)
    with pytest.raises(ValueError):
        bootstrap_ci([])


def test_bootstrap_matches_normal_approximation():
    # 100 fair 0/1 values: mean 0.5, standard error 0.05, so the CI is about 0.5 +- 0.098
    m, lo, hi = bootstrap_ci([float(i % 2) for i in range(100)], 2000, 0.95, 0)
    assert m == 0.5
    assert abs(lo - 0.402) < 0.02 and abs(hi - 0.598) < 0.02


@pytest.fixture(scope="module")
def judge():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TARGET)
    return tok, AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()


def test_judge_loglik_equals_token_by_token(judge):
    tok, model = judge
    prompt = tok("def add(a, b):").input_ids
    comp = tok("\n    return a + b\n").input_ids
    expect = []
    with torch.inference_mode():
        for k, t in enumerate(comp):  # one forward per prefix, last position only
            logits = model(input_ids=torch.tensor([prompt + comp[:k]])).logits[0, -1]
            expect.append(float(torch.log_softmax(logits.float(), -1)[t]))
    got = judge_logprobs(model, prompt, comp)
    assert got.shape == (len(comp),)
    torch.testing.assert_close(got, torch.tensor(expect), rtol=0, atol=1e-4)  # fp32, CPU
    assert judge_loglik(model, prompt, comp) == pytest.approx(sum(expect) / len(comp), abs=1e-4)
    with pytest.raises(ValueError, match="non-empty"):
        judge_loglik(model, prompt, [])
