"""End to end: SGLang's own server (CPU path, torch-native attention) serves the converted
code-dllm with `--dllm-algorithm Spiffy` on 127.0.0.1; greedy output must be token-identical to
our reference runtime (fp32 both). The server's processes import the torchvision shim through
`sglang_env/site/sitecustomize.py`; nothing else is shimmed or mocked.

DFlash through SGLang is not served here: SGLang 0.5.23 refuses `--speculative-algorithm DFLASH`
on a CPU device while resolving its arguments (see README "SGLang").
"""

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from dflash_plugin.engines.vllm_server import VLLMServer, free_port, request
from spiffy_plugin.decode import generate
from spiffy_plugin.engines.sdar import convert_to_sdar
from spiffy_plugin.params import DecodeParams

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]
SGLANG_ENV = ROOT / ".venv" / "sglang"
SITE = ROOT / "tests" / "engines" / "sglang_env" / "site"
DLLM = ROOT.parent / "shared" / "fixtures" / "code-dllm"
PROMPTS = [p["prompt"] for p in map(json.loads, (ROOT / "examples" / "fixtures" /
                                                   "dev-prompts.jsonl").read_text().splitlines())]


def sglang_env() -> dict[str, str]:
    parts = [str(ROOT), str(SGLANG_ENV), str(SITE)]
    parts += [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []
    return dict(os.environ, PYTHONPATH=os.pathsep.join(parts), SGLANG_PLUGINS="specdec",
                OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    if not (SGLANG_ENV / "soundfile.py").is_file():
        pytest.skip(f"SGLang test env missing ({SGLANG_ENV}): `make setup` installs it")
    if not (DLLM / "config.json").is_file():
        pytest.skip(f"code-dllm fixture not found at {DLLM}")
    tmp = tmp_path_factory.mktemp("sglang-serve")
    sdar = convert_to_sdar(DLLM, tmp / "code-dllm-sdar")
    from spiffy_plugin.graph import DraftGraph, Node

    DraftGraph((Node.of([(0, 0)], 1), Node.of([(0, 0), (1, 0)], 2)), (2, 1), 16, 16384,
               "vanilla-1").save(tmp / "graph.json")
    (tmp / "spiffy.yaml").write_text(f"graph: {tmp / 'graph.json'}\nkeep: 2\n")
    port = free_port()
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(sdar),
           "--device", "cpu", "--attention-backend", "torch_native", "--dtype", "float32",
           "--dllm-algorithm", "Spiffy", "--dllm-algorithm-config", str(tmp / "spiffy.yaml"),
           "--host", "127.0.0.1", "--port", str(port), "--max-total-tokens", "8192",
           "--skip-server-warmup"]
    with VLLMServer(cmd, env=sglang_env(), log_path=tmp / "sglang.log") as srv:
        yield srv, sdar


def test_sglang_serves_code_dllm_with_spiffy_token_identical(served):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    srv, sdar = served
    tok = AutoTokenizer.from_pretrained(sdar)
    model = AutoModelForCausalLM.from_pretrained(sdar, dtype=torch.float32).eval()
    eos = model.config.eos_token_id
    tokens = 0
    for text in PROMPTS[:2]:
        ids = tok(text).input_ids
        n = 32 - len(ids) % 16  # ends on a block boundary (SGLang always fills whole blocks)
        ref = [t for t in generate(model, ids, DecodeParams(unmask_per_step=1), n).tokens
               if t != eos]
        status, body = request(f"{srv.url}/generate", {
            "input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0}})
        assert status == 200, body
        got = [t for t in body["output_ids"] if t != eos]
        assert got == ref, (text[-60:], ref, got, srv.log_tail(1000))
        tokens += len(ref)
    assert tokens >= 30
    assert "Spiffy: graph" in srv.log_path.read_text()  # our algorithm served, not a builtin
