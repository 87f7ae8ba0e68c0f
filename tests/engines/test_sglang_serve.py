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

SpecFold: two more servers (delta 0 and 0.1, started together); see the section at the end.

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
DLLM = ROOT / "examples" / "fixtures" / "code-dllm"
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
    return dict(os.environ, PYTHONPATH=os.pathsep.join(parts),
                SGLANG_PLUGINS="spiffy_plugin,specfold_plugin", OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    if not (SGLANG_ENV / "soundfile.py").is_file():
        pytest.skip(f"SGLang test env missing ({SGLANG_ENV}): `make setup` installs it")
    assert (DLLM / "config.json").is_file(), f"bundled fixture missing: {DLLM}"
    tmp = tmp_path_factory.mktemp("sglang-serve")
    sdar = convert_to_sdar(DLLM, tmp / "code-dllm-sdar")
    GRAPH.save(tmp / "graph.json")
    # up to 2 requests denoised at once; the runner's limit leaves room for their draft rows
    (tmp / "spiffy.yaml").write_text(f"graph: {tmp / 'graph.json'}\nmax_running_requests: 2\n")
    with server(sdar, "Spiffy", tmp / "spiffy.yaml", tmp / "sglang.log") as srv:
        yield srv, sdar


def server(sdar: Path, algorithm: str, config: Path, log: Path, **env) -> VLLMServer:
    """SGLang's server (not started) for `algorithm` with the YAML `config`."""
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(sdar),
           "--device", "cpu", "--attention-backend", "torch_native", "--dtype", "float32",
           "--dllm-algorithm", algorithm, "--dllm-algorithm-config", str(config),
           "--host", "127.0.0.1", "--port", str(free_port()), "--max-total-tokens", "8192",
           "--max-running-requests", "16", "--skip-server-warmup"]
    return VLLMServer(cmd, env=dict(sglang_env(), **env), log_path=log,
                      startup_timeout=900)  # generous: 2-core CI machines under load


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


# SpecFold: two more servers, started together (delta = 0 and 0.1; the second dumps its first
# forwards with drafts: ids, tree, per-layer fold sets and logits, see `SpecFold._dump`).
FOLD_LINE = re.compile(r"SpecFold block: rid=(\S+) fold_forwards=(\d+) fold_qkv=([\d.]+) "
                       r"fold_ffn=([\d.]+) fold_qkv_drafts=([\d.]+) fold_ffn_drafts=([\d.]+)")


@pytest.fixture(scope="module")
def specfold(tmp_path_factory):
    if not (SGLANG_ENV / "soundfile.py").is_file():
        pytest.skip("SGLang test env missing (see `served`)")
    assert (DLLM / "config.json").is_file(), f"bundled fixture missing: {DLLM}"
    tmp = tmp_path_factory.mktemp("sglang-specfold")
    sdar = convert_to_sdar(DLLM, tmp / "code-dllm-sdar")
    GRAPH.save(tmp / "graph.json")
    servers = {}
    for delta in (0.0, 0.1):
        (tmp / f"{delta}.yaml").write_text(f"graph: {tmp / 'graph.json'}\ndelta: {delta}\n")
        env = {"SPECDEC_SPECFOLD_DUMP": str(tmp / "dump")} if delta else {}
        servers[delta] = server(sdar, "SpecFold", tmp / f"{delta}.yaml", tmp / f"{delta}.log",
                                **env)
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(VLLMServer.start, servers.values()))
        yield servers, sdar, tmp / "dump"
    finally:
        for srv in servers.values():
            srv.stop()


def _serve_one(srv, ids, n):
    """(output ids, the fold log lines of this request's blocks)."""
    status, body = request(f"{srv.url}/generate", {
        "input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0}})
    assert status == 200, body
    time.sleep(0.5)  # the scheduler logs a block just after streaming its output
    rid = body["meta_info"]["id"]
    return body["output_ids"], [tuple(map(float, m.groups()[1:])) for m in
                                FOLD_LINE.finditer(srv.log_path.read_text()) if m.group(1) == rid]


def test_sglang_specfold_delta_zero_folds_and_is_token_identical(specfold):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    servers, sdar, _ = specfold
    tok = AutoTokenizer.from_pretrained(sdar)
    model = AutoModelForCausalLM.from_pretrained(sdar, dtype=torch.float32).eval()
    eos = model.config.eos_token_id
    ids = tok(PROMPTS[0]).input_ids
    n = 48 - len(ids) % 16
    ref = [t for t in generate(model, ids, DecodeParams(unmask_per_step=1), n).tokens if t != eos]
    srv = servers[0.0]
    out, lines = _serve_one(srv, ids, n)
    assert [t for t in out if t != eos] == ref, srv.log_tail(2000)
    layers = model.config.num_hidden_layers
    assert f"SpecFold: folding {layers} SDAR layers (delta=0)" in srv.log_path.read_text()
    assert len(lines) == -(-n // 16) and all(f >= 1 for f, *_ in lines)
    # exact repeats of the parent (unchanged tokens, same layer input) fold at delta = 0
    assert sum(q for _, _, _, q, _ in lines) > 0, lines


def test_sglang_specfold_folds_like_the_reference(specfold):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specfold_plugin.fold import folded_forward
    from specfold_plugin.gate import gate
    from spiffy_plugin.runtime import BlockDiffusionRunner, dllm_spec

    servers, sdar, dump = specfold
    tok = AutoTokenizer.from_pretrained(sdar)
    model = AutoModelForCausalLM.from_pretrained(sdar, dtype=torch.float32).eval()
    ids = tok(PROMPTS[1]).input_ids
    n = 32 - len(ids) % 16
    srv = servers[0.1]
    out, lines = _serve_one(srv, ids, n)
    seq = ids + out
    assert lines and sum(q for _, _, _, q, _ in lines) > 0, lines  # fold ratio over drafts
    files = sorted(dump.glob("forward*.pt"))
    assert len(files) == 3, files
    spec, masks = dllm_spec(model.config), []

    def recording_gate(h, parents, delta):
        masks.append(gate(h, parents, delta))
        return masks[-1]

    for f in files:
        d = torch.load(f)
        (seqs, parents), = d["groups"]  # one request in flight
        p, bs = int(d["positions"][0]), spec.block_size
        blocks = d["input_ids"].view(-1, bs)[seqs]
        runner = BlockDiffusionRunner(model, spec)
        with torch.inference_mode():
            runner.forward(torch.tensor(seq[:p], dtype=torch.long), blocks[:1])
            masks.clear()
            want = folded_forward(runner, blocks, parents.tolist(), d["delta"],
                                  gate_fn=recording_gate)
        got_masks = [m[seqs] for layer in d["fold"] for m in layer]  # attn, ffn per layer
        assert len(got_masks) == len(masks)
        for i, (g, w) in enumerate(zip(got_masks, masks)):
            assert torch.equal(g, w), (f.name, i, g.int(), w.int())
        assert sum(int(m[1:].sum()) for m in masks) > 0  # this forward folded draft rows
        got = d["logits"][0]
        keep = torch.isfinite(want)
        torch.testing.assert_close(got[keep], want[keep], atol=2e-3, rtol=1e-3)
