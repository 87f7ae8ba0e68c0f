"""Measurements for `dflash tune --engine sglang` (GPU only: SGLang refuses DFLASH on CPU).

One `sglang.Engine` per candidate k, one after another in this process (scheduler and
detokenizer run in child processes; `shutdown` ends them): k = 0 without speculation, k > 0 with
DFLASH and a verify window `speculative_num_draft_tokens = k + 1`, which SGLang 0.5.16-0.5.23
accept below the drafter's block size (`DFLASHWorkerV2` logs a "block size mismatch" warning
and drafts that many). SGLang has no per-batch-size k for DFLASH (`speculative_adaptive` is
EAGLE/EAGLE3 only), so the output is one k per expected concurrency. Closed loop of c asyncio
workers over `Engine.async_generate`, as in `vllm_tune`; tau = completion tokens / verify
rounds (`meta_info["spec_verify_ct"]`); SGLang reports no per-position acceptance here.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable

from ..errors import ConfigError
from ..tune import Cell, Finished, measure_cells, report


def start(target: str, draft: str, k: int, *, max_running_requests: int, dtype: str = "auto",
          max_model_len: int = 2048, seed: int = 0, enforce_eager: bool = False,
          extra: dict | None = None):  # -> sglang.Engine
    import sglang

    kw = dict(model_path=target, tokenizer_path=target, dtype=dtype,
              context_length=max_model_len, random_seed=seed,
              max_running_requests=max_running_requests, disable_radix_cache=True)
    if enforce_eager:
        kw["disable_cuda_graph"] = True
    if k > 0:
        kw.update(speculative_algorithm="DFLASH", speculative_draft_model_path=draft,
                  speculative_num_draft_tokens=k + 1)
    kw.update(extra or {})
    return sglang.Engine(**kw)


def spread_lengths(n: int, mean: int, spread: float) -> list[int]:
    """n output lengths around `mean`, from mean * (1 - spread) to mean * (1 + spread), evenly
    spaced and interleaved (neighbours differ; the same list every call): requests of a closed
    loop then finish, and new ones arrive and are prefilled, a few at a time at any step, as in
    serving, not in waves. spread 0: every length `mean`."""
    if not 0.0 <= spread < 1.0:
        raise ConfigError("length_spread", f"must be in [0, 1), got {spread}")
    if spread == 0.0 or n < 2:
        return [mean] * n
    frac = [(i * 0.6180339887) % 1.0 for i in range(n)]  # [n] golden-ratio sequence in [0, 1)
    return [max(1, round(mean * (1.0 + spread * (2.0 * f - 1.0)))) for f in frac]


def closed_loop(engine, prompts: list[list[int]], max_tokens: int | list[int],
                concurrency: int, temperature: float = 0.0) -> list[Finished]:
    """Each prompt once, `concurrency` requests in flight; `max_tokens` per request (a list:
    the i-th prompt's), EOS ignored."""
    done: list[Finished | None] = [None] * len(prompts)
    todo = iter(range(len(prompts)))
    lens = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    sp = {"temperature": temperature, "top_p": 1.0, "ignore_eos": True}

    async def worker() -> None:
        for i in todo:  # one shared iterator: each worker takes the next prompt
            t0 = time.perf_counter()
            out = await engine.async_generate(input_ids=prompts[i], sampling_params=dict(
                sp, max_new_tokens=lens[i]))
            done[i] = Finished(list(out["output_ids"]), time.perf_counter() - t0, None,
                               out["meta_info"].get("spec_verify_ct"))

    async def main() -> None:
        await asyncio.gather(*(worker() for _ in range(concurrency)))

    engine.loop.run_until_complete(main())
    return done  # type: ignore[return-value]


def measure_engine(engine, k: int, prompts: list[list[int]], concurrencies: list[int], *,
                   temperature: float = 0.0, seed: int = 0, spread: float = 0.0,
                   **run) -> list[Cell]:
    """The cells of one started engine (`tune.measure_cells`; tau = committed tokens per
    verify round, from each request's `spec_verify_ct`); `spread` > 0: output lengths
    `spread_lengths` around the cells' token count."""
    def serve(ids, new_tokens, c):
        return closed_loop(engine, ids, spread_lengths(len(ids), new_tokens, spread), c,
                           temperature)

    def probe():
        def end(done):
            rounds = [d.verify_rounds for d in done]
            ntok = sum(len(d.token_ids) for d in done)
            return {"tau": ntok / sum(rounds) if k > 0 and all(rounds) else None}
        return end
    return measure_cells(serve, probe, k, prompts, concurrencies, name="sglang", **run)


def run(req, log: Callable[[str], None] | None = None) -> dict:
    """`dflash tune --engine sglang`: one engine per candidate k, the choice, the launch args."""
    import sglang

    from .vllm_tune import prompt_ids  # tokenizer only: no vLLM import

    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    opts = dict(req.engine_options)
    keep = opts["max_model_len"] - req.max_new_tokens - req.block_size - 8
    ids = prompt_ids(req.target, req.prompts, keep)
    run_opts = dict(max_new_tokens=req.max_new_tokens, waves=req.waves,
                    min_requests=req.min_requests,
                    warmup_tokens=req.warmup_tokens, temperature=req.temperature)
    cells: list[Cell] = []
    for k in req.candidates:
        t0 = time.perf_counter()
        engine = start(req.target, req.draft, k, max_running_requests=max(req.concurrency),
                       **opts)
        log(f"sglang k={k}: engine started in {time.perf_counter() - t0:.0f} s")
        try:
            cells += measure_engine(engine, k, ids, req.concurrency, log=log, **run_opts)
        finally:
            engine.shutdown()
    doc = report(cells, engine="sglang", draft=req.draft,
                 target_concurrency=req.target_concurrency, min_gain=req.min_gain)
    doc.update(engine_version=sglang.__version__, target=req.target, block_size=req.block_size,
               settings={**run_opts, **opts, "num_prompts": len(ids)})
    return doc
