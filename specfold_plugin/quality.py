"""Task quality of code completions, independent of token identity.

A *completion* is the generated text after a prompt; its *cut* is the completion up to (not
including) its last newline, i.e. its complete lines only (the whole completion if it ended with
EOS). *Parses* = prompt + cut is valid Python or a valid prefix of it (`parse_status` is not
"error"). The *judge* is an autoregressive LM scoring completion tokens given the prompt. The
*first line* is the completion's first line holding a non-space character.
"""

from __future__ import annotations

import ast
import codeop
import math
import random
import warnings

import torch


def cut_at_last_line(completion: str, ended: bool = False) -> str:
    """The complete lines of a completion: text before its last "\\n" ("" if it has none);
    `ended` (EOS reached) keeps all of it, since the file's last line is then complete."""
    if ended:
        return completion
    i = completion.rfind("\n")
    return completion[:i] if i >= 0 else ""


def parse_status(source: str) -> str:
    """"ok" if `ast.parse` accepts source; "incomplete" if it is a valid prefix of Python that
    more text could complete (an open bracket, string, docstring or block: `codeop` in "exec"
    mode returns None); else "error" (a syntax error inside the text)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SyntaxWarning / DeprecationWarning (escapes)
        try:
            ast.parse(source)
            return "ok"
        except (SyntaxError, ValueError):
            pass
        try:
            code = codeop.compile_command(source, "<completion>", "exec")
        except (SyntaxError, ValueError, OverflowError):
            return "error"
    return "incomplete" if code is None else "ok"


def completion_parses(prompt: str, completion: str, ended: bool = False) -> bool:
    """(a) for one prompt: prompt + cut_at_last_line(completion) is valid or a valid prefix.
    Prompts are cut from files mid-function or mid-docstring, so a strict `ast.parse` would
    fail on most of them whatever the completion; a prefix check fails only on a real error."""
    return parse_status(prompt + cut_at_last_line(completion, ended)) != "error"


def parse_rate(prompts: list[str], completions: list[str],
               ended: list[bool] | None = None) -> float:
    """Share of completions that parse (`completion_parses`)."""
    if len(prompts) != len(completions) or not prompts:
        raise ValueError(f"need as many prompts as completions (>= 1), got {len(prompts)} "
                         f"and {len(completions)}")
    ended = ended or [False] * len(prompts)
    ok = [completion_parses(p, c, e) for p, c, e in zip(prompts, completions, ended)]
    return sum(ok) / len(ok)


@torch.inference_mode()
def judge_logprobs(model, prompt_ids: list[int], completion_ids: list[int]) -> torch.Tensor:
    """Log-probability under an autoregressive `model` of each completion token given the
    prompt and the completion tokens before it: [len(completion_ids)] fp32, one forward."""
    if not prompt_ids or not completion_ids:
        raise ValueError(f"prompt_ids and completion_ids must be non-empty, got "
                         f"{len(prompt_ids)} and {len(completion_ids)}")
    dev = next(model.parameters()).device
    ids = torch.tensor([prompt_ids + completion_ids], device=dev)  # [1, n]
    logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1: -1].float()  # [m, vocab]
    target = ids[0, len(prompt_ids):]  # [m]
    return torch.log_softmax(logits, -1).gather(-1, target[:, None])[:, 0].cpu()


def judge_loglik(model, prompt_ids: list[int], completion_ids: list[int]) -> float:
    """(b) for one prompt: mean per-token log-likelihood (nats) of the completion."""
    return float(judge_logprobs(model, prompt_ids, completion_ids).mean())


def first_line(completion: str) -> str:
    """(c): the completion's first line with a non-space character, trailing spaces removed
    (leading indentation kept: it is Python syntax); "" if there is none. The text before the
    first newline counts as a line (it continues the prompt's last line)."""
    for line in completion.split("\n"):
        if line.strip():
            return line.rstrip()
    return ""


def bootstrap_ci(values: list[float], resamples: int = 2000, level: float = 0.95,
                 seed: int = 0) -> tuple[float, float, float]:
    """(mean, lo, hi): percentile bootstrap of the mean over the items of `values` (prompts):
    `resamples` means of n draws with replacement (random.Random(seed)), sorted; lo / hi are
    the order statistics at floor(a * R) and ceil((1 - a) * R) - 1, a = (1 - level) / 2."""
    if not values:
        raise ValueError("values must be non-empty")
    if resamples < 1 or not 0 < level < 1:
        raise ValueError(f"resamples must be >= 1 and level in (0, 1), got {resamples}, {level}")
    rng, n = random.Random(seed), len(values)
    means = sorted(math.fsum(values[rng.randrange(n)] for _ in range(n)) / n
                   for _ in range(resamples))
    a = (1 - level) / 2
    lo = means[math.floor(a * resamples)]
    hi = means[max(math.ceil((1 - a) * resamples) - 1, 0)]
    return math.fsum(values) / n, lo, hi
