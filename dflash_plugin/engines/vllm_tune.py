"""Measurements for `dflash tune --engine vllm`: one `vllm.LLM` per candidate k, started one
after another in this process (each engine's core runs in its own child process and holds the
memory; `close` ends it before the next starts), serving the prompts at each concurrency.

Concurrency is a closed loop: c requests in flight, each finished one replaced at once by the
next, max(waves * c, min_requests) requests per cell (prompts cycled), greedy unless a
temperature is given, a fixed number of new tokens (EOS ignored), prefix caching off (cycled
prompts are real prefills). An untimed pass at every concurrency comes first (CUDA-graph
shapes, compilation). tau and the per-position survival come from vLLM's own counters
(`LLM.get_metrics()`, which needs `disable_log_stats=False`; names as in vLLM 0.26 and 0.32),
read around each cell.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import asdict

from ..errors import require
from ..tune import Cell, Finished, acceptance, measure_cells, report

PREFIX = "vllm:spec_decode_"


def start(target: str, speculative_config: dict | None, *, max_num_seqs: int,
          dtype: str = "auto", max_model_len: int = 2048, seed: int = 0,
          enforce_eager: bool = False, extra: dict | None = None):  # -> vllm.LLM
    """A `vllm.LLM` for the target, with `speculative_config` (None: no speculation). Engine
    cores start by spawn unless the caller chose otherwise: after the first engine this
    process has touched CUDA, and a forked core then fails ("Cannot re-initialize CUDA in
    forked subprocess", seen with vLLM 0.26.0 on the H200)."""
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    import vllm

    kw = dict(model=target, tokenizer=target, dtype=dtype, max_model_len=max_model_len,
              seed=seed, enforce_eager=enforce_eager, disable_log_stats=False,
              max_num_seqs=max_num_seqs, enable_prefix_caching=False)
    if speculative_config is not None:
        kw["speculative_config"] = dict(speculative_config)
    kw.update(extra or {})
    return vllm.LLM(**kw)


def close(llm) -> None:
    engine_core = getattr(llm.llm_engine, "engine_core", None)
    if engine_core is not None:
        with contextlib.suppress(Exception):
            engine_core.shutdown()


def sampling_params(n: int, max_tokens: int, temperature: float = 0.0, seed: int = 0) -> list:
    from vllm import SamplingParams

    return [SamplingParams(temperature=temperature, top_p=1.0, max_tokens=max_tokens,
                           seed=None if temperature == 0 else seed + i, ignore_eos=True,
                           detokenize=False) for i in range(n)]


def closed_loop(llm, prompts: list[list[int]], params: list, concurrency: int) -> list[Finished]:
    """Serve token-id prompts with `concurrency` in flight: `LLM.enqueue` + `llm_engine.step()`
    from this thread (the calls `LLM.generate` makes, with submission interleaved)."""
    todo = iter(range(len(prompts)))
    inflight: dict[str, tuple[int, float]] = {}  # external request id -> (prompt index, t0)
    done: list[Finished | None] = [None] * len(prompts)

    def submit() -> None:
        i = next(todo, None)
        if i is not None:
            t0 = time.perf_counter()
            rid = llm.enqueue({"prompt_token_ids": prompts[i]}, params[i], use_tqdm=False)[0]
            # enqueue returns the internal id "<external>-<8 random chars>"; outputs carry the
            # external one (LLM's request counter, a decimal number).
            inflight[rid.split("-")[0]] = (i, t0)

    for _ in range(concurrency):
        submit()
    while inflight:
        for out in llm.llm_engine.step():
            if not out.finished:
                continue
            i, t0 = inflight.pop(out.request_id)
            ttft = getattr(out.metrics, "first_token_latency", None) or None
            done[i] = Finished(list(out.outputs[0].token_ids), time.perf_counter() - t0, ttft)
            submit()
    return done  # type: ignore[return-value]


def counters(llm) -> dict:
    """vLLM's speculative counters summed over engines: num_drafts, num_draft_tokens,
    num_accepted_tokens (Counter) and accepted_per_pos (the per-position Vector)."""
    out: dict = {"accepted_per_pos": []}
    for m in llm.get_metrics():
        if not m.name.startswith(PREFIX):
            continue
        name = m.name.removeprefix(PREFIX)
        if hasattr(m, "values"):  # num_accepted_tokens_per_pos
            pos, vals = out["accepted_per_pos"], list(m.values)
            n = max(len(pos), len(vals))
            pos, vals = pos + [0] * (n - len(pos)), vals + [0] * (n - len(vals))
            out["accepted_per_pos"] = [a + b for a, b in zip(pos, vals)]
        elif hasattr(m, "value"):
            out[name] = out.get(name, 0) + m.value
    return out


def measure_engine(llm, k: int, prompts: list[list[int]], concurrencies: list[int], *,
                   temperature: float = 0.0, seed: int = 0, **run) -> list[Cell]:
    """The cells of one started engine (`tune.measure_cells`; tau and survival from vLLM's
    spec-decode counters around each cell)."""
    def serve(ids, new_tokens, c):
        return closed_loop(llm, ids, sampling_params(len(ids), new_tokens, temperature, seed), c)

    def probe():
        before = counters(llm)
        return lambda done: acceptance(before, counters(llm))
    return measure_cells(serve, probe, k, prompts, concurrencies, name="vllm", **run)


def measure_config(target: str, speculative_config: dict | None, concurrencies: list[int],
                   prompts: list[list[int]], *, engine_options: dict,
                   log: Callable[[str], None] = print, **run) -> list[Cell]:
    """Start one engine with `speculative_config` (None: no speculation), measure every
    concurrency, close it. engine_options go to `start`, run options to `measure_engine`."""
    k = 0 if speculative_config is None else speculative_config["num_speculative_tokens"]
    t0 = time.perf_counter()
    llm = start(target, speculative_config, max_num_seqs=max(concurrencies), **engine_options)
    log(f"vllm k={k}: engine started in {time.perf_counter() - t0:.0f} s")
    try:
        return measure_engine(llm, k, prompts, concurrencies, log=log, **run)
    finally:
        close(llm)
        del llm


def measure(target: str, draft: str, candidates: list[int], concurrencies: list[int],
            prompts: list[list[int]], **kw) -> list[Cell]:
    """One engine per k in `candidates` (0: no speculation), one after another."""
    return [cell for k in candidates for cell in measure_config(
        target, None if k == 0 else {"method": "dflash", "model": draft,
                                     "num_speculative_tokens": k},
        concurrencies, prompts, **kw)]


def check_config(target: str, speculative_config: dict | None, *, max_num_seqs: int,
                 engine_options: dict) -> object:
    """The engine config vLLM builds from a `--speculative-config` (no engine started):
    `EngineArgs(...).create_engine_config().speculative_config` (None for None)."""
    from vllm.engine.arg_utils import EngineArgs

    opts = {k: v for k, v in engine_options.items() if k in ("dtype", "max_model_len", "seed",
                                                               "enforce_eager")}
    args = EngineArgs(model=target, tokenizer=target, max_num_seqs=max_num_seqs,
                      speculative_config=None if speculative_config is None
                      else dict(speculative_config), **opts)
    return args.create_engine_config().speculative_config


def prompt_ids(target: str, prompts: list[str], keep: int) -> list[list[int]]:
    """Token ids of each prompt with the target's tokenizer, left-truncated to `keep` tokens."""
    require(not isinstance(prompts, (str, bytes)) and all(isinstance(p, str) for p in prompts),
            "prompts", f"must be a list of prompt strings (`load_prompts_jsonl` reads a file), "
            f"got {type(prompts).__name__}")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    return [tok(p).input_ids[-keep:] for p in prompts]


def run(req, log: Callable[[str], None] | None = None) -> dict:
    """`dflash tune --engine vllm`: measure every candidate k, choose, emit and check the
    configs (they must load as vLLM's SpeculativeConfig); with req.check_table also serve the
    per-batch-size table config and measure it."""
    import sys

    import vllm

    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    opts = dict(req.engine_options)
    extra = opts.pop("extra", {})
    engine_options = {**opts, "extra": extra}
    keep = opts["max_model_len"] - req.max_new_tokens - req.block_size - 8
    ids = prompt_ids(req.target, req.prompts, keep)
    run_opts = dict(max_new_tokens=req.max_new_tokens, waves=req.waves,
                    min_requests=req.min_requests,
                    warmup_tokens=req.warmup_tokens, temperature=req.temperature,
                    seed=opts["seed"])
    cells = measure(req.target, req.draft, req.candidates, req.concurrency, ids,
                    engine_options=engine_options, log=log, **run_opts)
    doc = report(cells, engine="vllm", draft=req.draft, target_concurrency=req.target_concurrency,
                 min_gain=req.min_gain, max_num_seqs=max(req.concurrency))
    doc.update(engine_version=vllm.__version__, target=req.target, block_size=req.block_size,
               settings={**run_opts, **opts, "extra": extra, "num_prompts": len(ids)})
    out = doc["vllm"]
    checked = {}
    for key in ("speculative_config", "speculative_config_table"):
        try:
            spec = check_config(req.target, out[key], max_num_seqs=max(req.concurrency),
                                engine_options=opts)
            checked[key] = "loads" if out[key] is None or spec is not None else "dropped"
        except Exception as err:  # report it: the measurement above is still worth keeping
            checked[key] = f"{type(err).__name__}: {err}"
    out["checked"] = checked
    table = out["speculative_config_table"]
    if req.check_table and table is not None and "num_speculative_tokens_per_batch_size" in table:
        tcells = measure_config(req.target, table, req.concurrency, ids,
                                engine_options=engine_options, log=log, **run_opts)
        plain = {c.concurrency: c.tokens_per_s for c in cells if c.k == 0}
        out["table_check"] = [{**asdict(c), "vs_plain": (c.tokens_per_s / plain[c.concurrency]
                                                         if plain.get(c.concurrency) else None)}
                              for c in tcells]
    return doc
