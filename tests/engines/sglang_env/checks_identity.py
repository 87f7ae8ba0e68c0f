"""Token identity of SGLang's dLLM loop running our Spiffy step against our reference runtime.

Real: SGLang's `DllmAlgorithm.run` loops (sync and FDFO), the Spiffy algorithm class built from
command-line strings, the converted SDAR checkpoint. Mocked (SGLang has no CPU model forward):
`MockModelRunner` / `MockForwardBatch`, which score the canvas with our reference runtime
(`BlockDiffusionRunner`, exact KV cache of committed blocks) and stand in for the scheduler.
"""

import json
from types import SimpleNamespace

import pytest
import torch

from tests.engines.sglang_env import shims

shims.install()

from sglang.srt.dllm.algorithm import get_algorithm  # noqa: E402
from sglang.srt.dllm.config import DllmConfig  # noqa: E402

from spiffy_plugin.decode import generate  # noqa: E402
from spiffy_plugin.params import DecodeParams  # noqa: E402
from spiffy_plugin.runtime import BlockDiffusionRunner, dllm_spec  # noqa: E402
from tests.engines.sglang_env.fixtures import FIX, server_args  # noqa: E402


class MockModelRunner:
    """Stands in for SGLang's ModelRunner: one `forward` = one forward of our runtime over the
    committed context (KV cached) and the canvas; a finished block is committed on the next."""

    def __init__(self, model):
        self.runner = BlockDiffusionRunner(model, dllm_spec(model.config))
        self.pending = torch.zeros(0, dtype=torch.long)

    def forward(self, forward_batch, pp_proxy_tensors=None):
        ids = forward_batch.input_ids.view(1, -1)
        logits = self.runner.forward(self.pending, ids.clone())[0]
        self.pending = torch.zeros(0, dtype=torch.long)
        return SimpleNamespace(logits_output=SimpleNamespace(full_logits=logits),
                               can_run_graph=False)


def serve(algo, model, prompt: list[int], max_new_tokens: int, fdfo: bool) -> list[int]:
    """What SGLang's scheduler does per request: canvas = prompt tail + masks, run the algorithm
    until the block is done, emit it, commit it, next block; stop at EOS or the token limit."""
    bs, mask = algo.block_size, algo.mask_id
    mr = MockModelRunner(model)
    start = (len(prompt) // bs) * bs
    mr.pending = torch.tensor(prompt[:start])
    tail, out = prompt[start:], []
    while len(out) < max_new_tokens:
        canvas = torch.tensor(tail + [mask] * (bs - len(tail)))
        fb = SimpleNamespace(batch_size=1, input_ids=canvas, dllm_prompt_mask=(
            torch.arange(bs) < len(tail))[None], mark_forward_metadata_ready=lambda **k: None)
        if fdfo:
            states = None
            while True:
                _, _, accepted, states, _ = algo.run(mr, fb, states)
                if accepted[0]:
                    break
        else:
            algo.run(mr, fb)
        out += canvas[len(tail):].tolist()
        mr.pending, tail = canvas.clone(), []
        if algo.cfg.eos_token_id in out:
            return out[: out.index(algo.cfg.eos_token_id) + 1]
    return out[:max_new_tokens]


@pytest.mark.parametrize("fdfo", [False, True])
def test_sglang_loop_with_spiffy_step_matches_reference(sdar_dir, graph_path, tmp_path, fdfo):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_plugin.training.data import load_prompts_jsonl

    sa = server_args(sdar_dir, "Spiffy", {"graph": graph_path}, tmp_path)
    config = DllmConfig.from_server_args(sa)
    config.first_done_first_out_mode = fdfo
    algo = get_algorithm(config)
    tok = AutoTokenizer.from_pretrained(sdar_dir)
    model = AutoModelForCausalLM.from_pretrained(sdar_dir, dtype=torch.float32).eval()
    compared = 0
    for text in load_prompts_jsonl(FIX / "dev-prompts.jsonl")[:3]:
        prompt = tok(text).input_ids
        n = 48 - len(prompt) % 16  # ends on a block boundary, like SGLang's canvas
        ref = generate(model, prompt, DecodeParams(unmask_per_step=1), n).tokens
        with torch.inference_mode():
            got = serve(algo, model, prompt, n, fdfo)
        assert got == ref, json.dumps({"prompt": text[-60:], "ref": ref, "sglang": got})
        compared += len(ref)
    assert compared >= 60
