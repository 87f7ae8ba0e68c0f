"""End to end: SGLang's own server (CPU path, torch-native attention) serves the converted
code-dllm with `--dllm-algorithm Spiffy` on 127.0.0.1. Greedy output must be token-identical to
our reference runtime's vanilla decoding and to `spiffy generate` (fp32 both), and SGLang must
spend fewer model forwards per block than one-step decoding. The server's processes import the
torchvision shim through `sglang_env/site/sitecustomize.py`; nothing else is shimmed or mocked.

How forwards are counted: the algorithm logs one line per finished block ("Spiffy block:
rid=... forwards=F steps=S"), and SGLang itself logs one "Prefill batch" line per scheduler
forward (FDFO, the default: one model forward each); the test checks that the two agree. The
one-step baseline is derived, not served: one forward per denoising step plus the forward that
persists the block's final canvas (S + 1 per block, as SGLang's loops run a one-step algorithm;
`sglang_env/checks_identity.py` measures exactly that in SGLang's loop), on the same trajectory:
the test checks that S equals our reference vanilla decoder's step count.

DFlash through SGLang is not served here: SGLang 0.5.23 refuses `--speculative-algorithm DFLASH`
on a CPU device while resolving its arguments (see README "SGLang").
"""

import json
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from dflash_plugin.engines.vllm_server import VLLMServer, free_port, request
from spiffy_plugin.decode import generate
from spiffy_plugin.engines.sdar import convert_to_sdar
from spiffy_plugin.graph import DraftGraph, Node
from spiffy_plugin.params import DecodeParams
from spiffy_plugin.spiffy import spiffy_generate

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]
SGLANG_ENV = ROOT / ".venv" / "sglang"
SITE = ROOT / "tests" / "engines" / "sglang_env" / "site"
DLLM = ROOT.parent / "shared" / "fixtures" / "code-dllm"
PROMPTS = [p["prompt"] for p in map(json.loads, (ROOT / "examples" / "fixtures" /
                                                   "dev-prompts.jsonl").read_text().splitlines())]
# A hand-made chain of guesses "the next 1 / 2 / 3 steps fill the most confident positions with
# their top tokens" plus one alternative; `spiffy calibrate` makes better ones.
GRAPH = DraftGraph((Node.of([(0, 0)], 1), Node.of([(0, 1)], 1), Node.of([(0, 0), (1, 0)], 2),
                    Node.of([(0, 0), (1, 0), (2, 0)], 3)), (4, 1, 3, 2), 16, 16384, "vanilla-1")
BLOCK_LINE = re.compile(r"Spiffy block: rid=(\S+) forwards=(\d+) steps=(\d+) accepted=(\d+)")


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
    GRAPH.save(tmp / "graph.json")
    # up to 2 requests denoised at once; the runner's limit leaves room for their draft rows
    (tmp / "spiffy.yaml").write_text(f"graph: {tmp / 'graph.json'}\nmax_running_requests: 2\n")
    port = free_port()
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(sdar),
           "--device", "cpu", "--attention-backend", "torch_native", "--dtype", "float32",
           "--dllm-algorithm", "Spiffy", "--dllm-algorithm-config", str(tmp / "spiffy.yaml"),
           "--host", "127.0.0.1", "--port", str(port), "--max-total-tokens", "8192",
           "--max-running-requests", "16", "--skip-server-warmup"]
    with VLLMServer(cmd, env=sglang_env(), log_path=tmp / "sglang.log") as srv:
        yield srv, sdar


def forward_lines(log: str) -> int:
    return log.count("Prefill batch")


def test_sglang_serves_code_dllm_with_spiffy_token_identical_and_fewer_forwards(served):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    srv, sdar = served
    tok = AutoTokenizer.from_pretrained(sdar)
    model = AutoModelForCausalLM.from_pretrained(sdar, dtype=torch.float32).eval()
    params = DecodeParams(unmask_per_step=1)
    jobs = []
    for text in PROMPTS[:2]:
        ids = tok(text).input_ids
        n = 48 - len(ids) % 16  # ends on a block boundary (SGLang always fills whole blocks)
        ref = generate(model, ids, params, n)
        assert spiffy_generate(model, ids, GRAPH, params, n).tokens == ref.tokens
        jobs.append((ids, n, ref))
    before = forward_lines(srv.log_path.read_text())
    rids, prefill = [], 0
    for ids, n, ref in jobs:  # one at a time: SGLang's per-forward lines are this request's
        status, body = request(f"{srv.url}/generate", {
            "input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0}})
        assert status == 200, body
        got = [t for t in body["output_ids"] if t != model.config.eos_token_id]
        want = [t for t in ref.tokens if t != model.config.eos_token_id]
        assert got == want, (want, got, srv.log_tail(2000))
        rids.append(body["meta_info"]["id"])
        prefill += len(ids) // 16  # SGLang encodes each full prompt block in its own forward
    blocks = {rid: [] for rid in rids}
    deadline = time.time() + 10  # the scheduler logs a forward just after streaming its output
    while True:
        log = srv.log_path.read_text()
        for m in BLOCK_LINE.finditer(log):
            if m.group(1) in blocks:
                blocks[m.group(1)].append((int(m.group(2)), int(m.group(3))))
        forwards = sum(f for b in blocks.values() for f, _ in b)
        if forward_lines(log) - before >= prefill + forwards or time.time() > deadline:
            break
        blocks = {rid: [] for rid in rids}
        time.sleep(0.2)
    assert forward_lines(log) - before == prefill + forwards  # our counter = SGLang's forwards
    one_step = 0
    for (_, n, ref), rid in zip(jobs, rids):
        assert len(blocks[rid]) == -(-n // 16)
        steps = sum(s for _, s in blocks[rid])
        assert steps == ref.steps  # the very trajectory of vanilla decoding
        one_step += steps + len(blocks[rid])
    print(f"SGLang forwards for {len(jobs)} requests: Spiffy {forwards}, one-step {one_step} "
          f"({one_step / forwards:.2f}x fewer)")
    assert forwards < 0.8 * one_step
    assert "Spiffy: graph" in log  # our algorithm served, not a builtin


def test_sglang_batches_two_requests_with_their_drafts(served):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    srv, sdar = served
    tok = AutoTokenizer.from_pretrained(sdar)
    model = AutoModelForCausalLM.from_pretrained(sdar, dtype=torch.float32).eval()
    eos = model.config.eos_token_id
    prompts = [tok(t).input_ids[-40:] for t in PROMPTS[2:4]]  # 2 prompt blocks + 8 tokens
    refs = [[t for t in generate(model, p, DecodeParams(unmask_per_step=1), 24).tokens
             if t != eos] for p in prompts]
    before = len(srv.log_path.read_text())

    def go(ids):
        return request(f"{srv.url}/generate", {
            "input_ids": ids, "sampling_params": {"max_new_tokens": 24, "temperature": 0}})

    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(go, prompts))
    rids = []
    for (status, body), ref in zip(answers, refs):
        assert status == 200 and [t for t in body["output_ids"] if t != eos] == ref, (ref, body)
        rids.append(body["meta_info"]["id"])
    time.sleep(0.5)
    log = srv.log_path.read_text()[before:]
    assert "#new-seq: 2," in log  # the two requests shared forwards
    accepted = [int(m.group(4)) for m in BLOCK_LINE.finditer(log) if m.group(1) in rids]
    assert len(accepted) == 4 and sum(accepted) > 0  # with their drafts
    assert "not every draft fits" not in log
