"""Sampled decoding (temperature / top-p per request) of Spiffy inside SGLang's dLLM loops.

Real: SGLang's loops, ForwardBatch, pools, `SamplingParams` (its normalisation: temperature 0 is
stored as temperature 1 with top_k 1; its `verify`), `DllmConfig.validate_request` (what the
scheduler calls per request), the Spiffy class built from command-line strings. Mocked, as in
`checks_identity.py` (whose `SlotRunner` and `serve` run here): the model forward, the scheduler,
and `ForwardBatch.sampling_info`, built per batch from each request's real `SamplingParams` with
the fields `SamplingBatchInfo.from_schedule_batch` fills (temperatures, top_ps, top_ks, min_ps,
sampling_seed, is_all_greedy).

With the same seed the reference runtime (`spiffy_generate`, what `spiffy generate
--temperature` runs) and SGLang draw the same stream on CPU, so tokens must be identical. The
statistical test compares SGLang's and the reference's distributions of sampled completions with
independent seeds (chi-square, stated thresholds).
"""

from types import SimpleNamespace

import pytest
import torch
from scipy.stats import chi2_contingency, chisquare

from tests.engines.sglang_env import checks_identity as ci
from tests.engines.sglang_env import shims

shims.install()

from sglang.srt.dllm.algorithm import get_algorithm  # noqa: E402
from sglang.srt.dllm.config import DllmConfig  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

from spiffy_plugin.decode import step_distribution  # noqa: E402
from spiffy_plugin.engines import sglang_algorithm  # noqa: E402
from spiffy_plugin.engines.sglang import request_seed  # noqa: E402
from spiffy_plugin.graph import load_graph  # noqa: E402
from spiffy_plugin.params import DecodeParams  # noqa: E402
from spiffy_plugin.runtime import BlockDiffusionRunner, dllm_spec  # noqa: E402
from spiffy_plugin.spiffy import spiffy_generate  # noqa: E402
from tests.engines.sglang_env.fixtures import server_args  # noqa: E402

VOCAB = 16384
PROMPT = [5, 17, 29, 41, 53, 65, 77, 89, 101, 113, 125, 137]  # 12 tokens: 4 generated / block


@pytest.fixture(scope="module")
def model(sdar_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(sdar_dir, dtype=torch.float32).eval()


def params(**kw) -> SamplingParams:
    sp = SamplingParams(max_new_tokens=64, **kw)
    sp.verify(VOCAB)
    return sp


def with_sampling(monkeypatch, by_rid: dict, deterministic: bool = False):
    """`serve`'s ForwardBatch gets the `sampling_info` SGLang builds from each request's
    SamplingParams (`SamplingBatchInfo.from_schedule_batch`); `sampling_seed` only with
    `deterministic` (SGLang's --enable-deterministic-inference, 42 where a request has none)."""
    plain = ci.forward_batch

    def forward_batch(reqs, bs):
        fb = plain(reqs, bs)
        sp = [by_rid[r["rid"]] for r in reqs]
        fb.sampling_info = SimpleNamespace(
            temperatures=torch.tensor([s.temperature for s in sp]).view(-1, 1),
            top_ps=torch.tensor([s.top_p for s in sp]),
            top_ks=torch.tensor([s.top_k for s in sp], dtype=torch.int32),
            min_ps=torch.tensor([s.min_p for s in sp]),
            sampling_seed=torch.tensor([42 if s.sampling_seed is None else s.sampling_seed
                                        for s in sp]) if deterministic else None,
            is_all_greedy=all(s.top_k <= 1 for s in sp))
        return fb

    monkeypatch.setattr(ci, "forward_batch", forward_batch)


def spiffy_algorithm(sdar_dir, graph_path, tmp_path, fdfo: bool, seed: int | None = None):
    cfg = {"graph": graph_path} | ({} if seed is None else {"seed": seed})
    config = DllmConfig.from_server_args(server_args(sdar_dir, "Spiffy", cfg, tmp_path))
    config.first_done_first_out_mode = fdfo
    return config, get_algorithm(config)


def reference(model, graph_path, prompt, sp: SamplingParams, seed: int, n: int) -> list[int]:
    t = 0.0 if sp.top_k <= 1 else sp.temperature
    p = DecodeParams(unmask_per_step=1, temperature=t, top_p=sp.top_p, seed=seed)
    return spiffy_generate(model, prompt, load_graph(graph_path), p, n).tokens


@pytest.mark.parametrize("fdfo", [False, True])
def test_sampled_tokens_identical_to_reference_for_a_fixed_seed(
        sdar_dir, graph_path, tmp_path, model, monkeypatch, fdfo):
    """Three sampled requests (seed from the request via `validate_request`, from SGLang's
    deterministic `sampling_seed`, from the YAML seed + rid) and a greedy one, batched together
    over two blocks: each equals the reference with that seed, token for token."""
    config, algo = spiffy_algorithm(sdar_dir, graph_path, tmp_path, fdfo, seed=7)
    prompts = [PROMPT, PROMPT[:5], PROMPT + [149, 161, 173, 185], PROMPT[:9]]
    sps = {"r0": params(temperature=0.8, top_p=0.9, sampling_seed=1234),
           "r1": params(temperature=1.0, sampling_seed=-5),
           "r2": params(temperature=1.3, top_p=0.95),
           "r3": params(temperature=0.0, top_p=0.5)}
    # r0's seed reaches the algorithm through the scheduler's per-request check; in FDFO mode
    # (run as SGLang's deterministic inference) every seed also comes in sampling_info, where r2
    # gets SGLang's 42; otherwise r1's is not seen and r1, r2 use YAML seed 7 + their rid.
    assert config.validate_request(SimpleNamespace(rid="r0", sampling_params=sps["r0"])) is None
    with_sampling(monkeypatch, sps, deterministic=fdfo)
    seeds = {"r0": 1234, "r1": -5 if fdfo else request_seed(7, "r1"),
             "r2": 42 if fdfo else request_seed(7, "r2"), "r3": 0}
    n = 24
    refs = [reference(model, graph_path, p, sps[f"r{k}"], seeds[f"r{k}"], 32 - len(p) % 16)
            for k, p in enumerate(prompts)]
    mr = ci.SlotRunner(model, algo.block_size, rows=32)
    with torch.inference_mode():
        got = ci.serve(algo, mr, prompts, n, fdfo)
    for k, (ref, g) in enumerate(zip(refs, got)):
        assert g[: len(ref)] == ref, (k, ref, g)
    assert algo.totals["accepted"] > 0  # drafts were verified under sampling too
    greedy = reference(model, graph_path, prompts[3], params(temperature=0.0), 0, 23)
    assert got[3][:23] == greedy
    assert got[0][:8] != reference(model, graph_path, prompts[0], sps["r0"], 1235, 8)


def test_request_check_rejects_what_cannot_be_replayed(sdar_dir, graph_path, tmp_path):
    """Bad temperature / top_p are SGLang's own 400 (`SamplingParams.verify`, before the
    scheduler); top_k / min_p, which the reference cannot replay, are ours, per request."""
    config, _ = spiffy_algorithm(sdar_dir, graph_path, tmp_path, False)
    with pytest.raises(ValueError, match="temperature must be a non-negative"):
        params(temperature=-0.5)
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="top_p must be in"):
            params(temperature=1.0, top_p=bad)
    req = SimpleNamespace(rid="x", sampling_params=params(temperature=1.0, top_k=20))
    assert "top_k=20 is not supported" in config.validate_request(req)
    req = SimpleNamespace(rid="x", sampling_params=params(temperature=1.0, min_p=0.1))
    assert "min_p=0.1 is not supported" in config.validate_request(req)
    for ok in (params(temperature=0.7, top_p=0.8), params(temperature=0.0, top_k=7), params()):
        assert config.validate_request(SimpleNamespace(rid="y", sampling_params=ok)) is None
    sglang_algorithm.REQUEST_SEEDS.clear()


N = 200  # sampled completions per side
TEXT = "import numpy as np\n\n\ndef softmax(x, axis=-1):\n    x = np."


def _padded(tokens: list[int]) -> tuple:  # a block cut at EOS, padded to its positions
    return tuple(tokens[:3]) + (None,) * (3 - len(tokens[:3]))


def _first_blocks(model, graph_path, sdar_dir, tmp_path, monkeypatch, prompt, sp, fdfo=True):
    """N completions in SGLang batches of 100 requests (1 + D* rows each); `serve` names them
    r0..r99, so each batch gets its own algorithm (YAML seed 11 + batch) for fresh streams."""
    with_sampling(monkeypatch, {f"r{k}": sp for k in range(100)})
    out, accepted = [], 0
    for lo in range(0, N, 100):
        _, algo = spiffy_algorithm(sdar_dir, graph_path, tmp_path, fdfo, seed=11 + lo)
        mr = ci.SlotRunner(model, algo.block_size, slots=100 * 4 * 16 + 64, rows=400)
        with torch.inference_mode():
            got = ci.serve(algo, mr, [prompt] * 100, 3, fdfo)
        out += [_padded(g) for g in got]
        accepted += algo.totals["accepted"]
    return out, accepted


def _binned(counts: list, probs: dict, n: int) -> tuple[list[float], list[float]]:
    """Observed / expected counts over the tokens expected >= 5 times, the rest pooled."""
    keep = [t for t, q in probs.items() if q * n >= 5]
    obs = [counts.count(t) for t in keep] + [sum(x not in keep for x in counts)]
    exp = [probs[t] * n for t in keep] + [n - sum(probs[t] * n for t in keep)]
    return obs, [e * sum(obs) / sum(exp) for e in exp]


def _two_sample(a: list, b: list, min_count: int = 10) -> tuple[float, float, int]:
    """Chi-square p of `a` vs `b` (categories with >= min_count hits together, the rest pooled),
    the total-variation distance over the same bins, and the number of bins."""
    cats = sorted(set(a) | set(b), key=str)
    common = [c for c in cats if a.count(c) + b.count(c) >= min_count]
    table = [[s.count(c) for c in common] + [sum(x not in common for x in s)] for s in (a, b)]
    if table[0][-1] + table[1][-1] == 0:
        table = [row[:-1] for row in table]
    tv = 0.5 * sum(abs(x / len(a) - y / len(b)) for x, y in zip(*table))
    return float(chi2_contingency(table).pvalue), tv, len(table[0])


def test_sampled_distribution_matches_reference(sdar_dir, graph_path, tmp_path, model,
                                                monkeypatch):
    """N sampled completions of one code prompt (3 positions left in its block) through
    SGLang's FDFO loop with drafts (seeds: YAML seed + rid) vs N of the reference runtime
    (`spiffy_generate`, seeds 0..N-1), T=1, top-p 0.95.
    (1) The first denoising step's token (the most confident position), one-sample chi-square
    against its exact distribution from the reference's first forward: p > 0.001. Power: the
    same counts against the exact T=0.7 distribution are rejected, p < 1e-4.
    (2) The whole block (3 tokens, rare blocks pooled) and its first token, two-sample
    chi-square, SGLang vs reference: p > 0.001 each; total variation over the first
    token's bins < 0.15."""
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(sdar_dir)(TEXT).input_ids[-13:]
    sp = params(temperature=1.0, top_p=0.95)
    got, accepted = _first_blocks(model, graph_path, sdar_dir, tmp_path, monkeypatch, prompt, sp)
    assert accepted > 0
    graph = load_graph(graph_path)
    ref = [_padded(spiffy_generate(model, prompt, graph, DecodeParams(
        temperature=1.0, top_p=0.95, seed=s), 3).tokens) for s in range(N)]
    spec = dllm_spec(model.config)
    ids = torch.full((1, 16), spec.mask_token_id)
    ids[0, :13] = torch.tensor(prompt)
    with torch.inference_mode():
        logits = BlockDiffusionRunner(model, spec).forward(ids[0, :0], ids)[0].clone()
        logits[:, list(spec.banned_token_ids)] = float("-inf")
    probs = step_distribution(logits, DecodeParams(temperature=1.0, top_p=0.95))
    conf = probs.max(-1).values
    conf[:13] = -1.0
    pos = int(conf.argmax()) - 13
    first = [g[pos] for g in got]

    def exact(t: float) -> dict:
        q = step_distribution(logits, DecodeParams(temperature=t, top_p=0.95))[pos + 13].double()
        return {k: float(q[k]) for k in torch.nonzero(q).view(-1).tolist()}

    obs, exp = _binned(first, exact(1.0), N)
    p1 = float(chisquare(obs, exp).pvalue)
    p_cold = float(chisquare(*_binned(first, exact(0.7), N)).pvalue)
    p2, tv2, k2 = _two_sample([g[0] for g in got], [r[0] for r in ref])
    p3, tv3, k3 = _two_sample(got, ref)
    print(f"sampling: first step (position {pos}) p={p1:.4f} over {len(obs)} bins, vs T=0.7 "
          f"p={p_cold:.2e}; first token p={p2:.4f} tv={tv2:.3f} ({k2} bins); block p={p3:.4f} "
          f"tv={tv3:.3f} ({k3} bins)")
    assert len(obs) >= 3 and k2 >= 3 and k3 >= 3, "the sampled distribution is too peaked"
    assert p1 > 1e-3 and p2 > 1e-3 and p3 > 1e-3, (p1, p2, p3)
    assert tv2 < 0.15, tv2
    assert p_cold < 1e-4, p_cold
