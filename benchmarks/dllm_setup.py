"""Shared set-up of the fp32 SpecFold experiments (`specfold_gate_ref.py`, `capacity_replay.py`,
`specfold_sensitivity.py`): the fixture's arguments, the model, the eval prompts and a draft
graph calibrated on other prompts (vanilla rule, D = --budget)."""

from __future__ import annotations

import argparse
from typing import NamedTuple

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from spiffy_plugin.calibrate import calibrate
from spiffy_plugin.cli import read_prompts
from spiffy_plugin.decode import DecodeParams
from spiffy_plugin.graph import DraftGraph


class Setup(NamedTuple):
    model: torch.nn.Module
    evals: list[list[int]]  # eval prompts' token ids
    graph: DraftGraph
    params: DecodeParams
    max_new_tokens: int


def add_args(p: argparse.ArgumentParser, eval_default: str) -> None:
    p.add_argument("--model", required=True, help="the code-dllm fixture directory")
    p.add_argument("--prompts", default="examples/fixtures/dev-prompts.jsonl")
    p.add_argument("--calib", default="32:40", help="prompts the graph is calibrated on")
    p.add_argument("--eval", default=eval_default, help="prompts decoded, start:stop")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--budget", type=int, default=10, help="D: draft graph nodes")


def load(a: argparse.Namespace, device: str = "cpu") -> Setup:
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).to(device).eval()
    prompts = read_prompts(a.prompts)
    calib, evals = ([tok(x).input_ids for x in prompts[slice(*map(int, s.split(":")))]]
                    for s in (a.calib, a.eval))
    params = DecodeParams()
    graph = calibrate(model, calib, a.budget, params, a.max_new_tokens)
    return Setup(model, evals, graph, params, a.max_new_tokens)
