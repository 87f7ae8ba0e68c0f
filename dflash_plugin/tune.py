"""`dflash tune`: choose the number of drafted tokens k per concurrency from engine measurements.

A *cell* is one measurement of an engine started with k drafted tokens per round (k = 0: no
speculation, plain decoding) serving c concurrent requests: output tokens/s, and for k > 0 the
engine's tau (tokens per round) and per-position survival s_j = P(accepted >= j). Per c the
choice is the k of the most tokens/s, and k = 0 unless a k > 0 beats plain by `min_gain`. The
choices become engine configs: vLLM `--speculative-config` JSON (fixed k, or the per-batch-size
table `num_speculative_tokens_per_batch_size`), SGLang launch args. No engine is imported here.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .adaptive import best_block
from .errors import ConfigError, require


@dataclass
class Finished:
    """One finished request of a measurement (engine adapters fill it)."""

    token_ids: list[int]
    latency_s: float  # submission -> completion, measured by the caller
    ttft_s: float | None = None  # arrival -> first token, from the engine; None if unknown
    verify_rounds: int | None = None  # SGLang spec_verify_ct (target verify forwards)


@dataclass(frozen=True)
class Cell:
    """One measured (k, concurrency) pair."""

    k: int  # drafted tokens per round; 0 = the engine without speculation
    concurrency: int
    tokens_per_s: float
    tau: float | None = None  # 1 + accepted / rounds, from the engine's counters (k > 0)
    survival: list[float] = field(default_factory=list)  # s_1..s_k (k > 0)
    wall_s: float | None = None
    requests: int | None = None


def measure_cells(
    serve: Callable[[list[list[int]], int, int], list[Finished]],  # (ids, new tokens, c)
    probe: Callable[[], Callable[[list[Finished]], dict]],  # () -> (done -> tau, survival)
    k: int, prompts: list[list[int]], concurrencies: list[int], *, max_new_tokens: int,
    waves: int = 16, min_requests: int = 1, warmup_tokens: int = 8, name: str = "engine",
    min_seconds: float = 0.0, log: Callable[[str], None] = print,
) -> list[Cell]:
    """The cells of one started engine (k: its drafted tokens per round, for the record): an
    untimed closed loop at every concurrency (every batch shape once), then per concurrency c
    max(waves * c, min_requests) requests (prompts cycled) through `serve`, timed, and again
    until the cell has run `min_seconds` (a few-percent comparison needs windows of seconds,
    not the fraction of a second a small model serves 64 requests in); `probe()` is called
    before each timed cell and its result after it gives tau and the survival (the engine's
    counters around the cell, or the requests' own counts)."""
    def batch(c: int) -> list[list[int]]:
        return [prompts[i % len(prompts)] for i in range(max(waves * c, min_requests))]

    for c in concurrencies:
        serve(batch(c), warmup_tokens, c)
    cells = []
    for c in concurrencies:
        ids = batch(c)
        end, done, wall = probe(), [], 0.0
        while not done or wall < min_seconds:
            t0 = time.perf_counter()
            done += serve(ids, max_new_tokens, c)
            wall += time.perf_counter() - t0
        acc = end(done)
        ntok = sum(len(d.token_ids) for d in done)
        cell = Cell(k=k, concurrency=c, tokens_per_s=ntok / wall, tau=acc.get("tau"),
                    survival=acc.get("survival") or [], wall_s=wall, requests=len(done))
        cells.append(cell)
        tau = "-" if cell.tau is None else f"{cell.tau:.2f}"
        log(f"{name} k={k} c={c}: {cell.tokens_per_s:.1f} tok/s, tau {tau}, {wall:.2f} s")
    return cells


def parse_int_list(text: str, name: str, lo: int, hi: int | None = None) -> list[int]:
    """"1,4,8" -> [1, 4, 8] (sorted, unique), every value in [lo, hi]; ConfigError naming `name`."""
    try:
        vals = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ConfigError(name, f"must be comma-separated integers, got {text!r}") from None
    bad = [v for v in vals if v < lo or (hi is not None and v > hi)]
    allowed = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
    require(bool(vals), name, f"needs at least one value, got {text!r}")
    require(not bad, name, f"values must be {allowed}, got {bad}")
    return vals


def validate_candidates(candidates: list[int], block_size: int) -> list[int]:
    """The drafter proposes at most block_size - 1 tokens per round (one anchor + masks)."""
    require(block_size >= 2, "block_size", f"the drafter's block size must be >= 2, got "
            f"{block_size}")
    bad = [k for k in candidates if not 0 <= k <= block_size - 1]
    require(not bad, "--candidates", f"values must be in [0, {block_size - 1}] (drafter block "
            f"size {block_size}), got {bad}")
    return sorted(set(candidates))


def by_concurrency(cells: list[Cell]) -> dict[int, dict[int, Cell]]:
    out: dict[int, dict[int, Cell]] = {}
    for c in cells:
        require(c.k >= 0 and c.concurrency >= 1 and c.tokens_per_s >= 0, "cells",
                f"k >= 0, concurrency >= 1, tokens_per_s >= 0; got {c}")
        out.setdefault(c.concurrency, {})[c.k] = c
    return out


def best_k(row: dict[int, Cell], min_gain: float = 0.02) -> int:
    """k of the most tokens/s at one concurrency (ties: the smaller k). Without a k = 0 cell the
    best measured k wins; with one, a k > 0 must reach (1 + min_gain) x plain's tokens/s."""
    require(bool(row), "cells", "no measurement at this concurrency")
    require(min_gain >= 0, "min_gain", f"must be >= 0, got {min_gain}")
    top = max(sorted(row), key=lambda k: row[k].tokens_per_s)
    if 0 in row and top != 0 and row[top].tokens_per_s < (1 + min_gain) * row[0].tokens_per_s:
        return 0
    return top


def choose(cells: list[Cell], min_gain: float = 0.02) -> dict[int, int]:
    """concurrency -> chosen k."""
    return {c: best_k(row, min_gain) for c, row in sorted(by_concurrency(cells).items())}


def round_ms(row: dict[int, Cell]) -> dict[int, float]:
    """Block length q = k + 1 -> ms of one engine step, from tokens/s = c * tau / step time
    (k = 0: tau = 1). Cells without tau (k > 0, counters missing) are left out."""
    out = {}
    for k, cell in row.items():
        tau = 1.0 if k == 0 else cell.tau
        if tau and cell.tokens_per_s > 0:
            out[k + 1] = 1e3 * cell.concurrency * tau / cell.tokens_per_s
    return out


def model_k(row: dict[int, Cell]) -> int | None:
    """The cost model's k at one concurrency (`adaptive.best_block`): the measured step time of
    each k with the acceptance of the longest measured draft, E(q) = 1 + s_1 + .. + s_{q-1}.
    A cross-check of the measured choice (it assumes survival does not depend on k)."""
    ms = round_ms(row)
    longest = max((k for k in row if row[k].survival), default=None)
    if not ms or longest is None:
        return None
    return best_block(ms, row[longest].survival) - 1


def batch_size_table(choice: dict[int, int], max_num_seqs: int | None = None) -> list[list[int]]:
    """vLLM `num_speculative_tokens_per_batch_size`: inclusive ranges [start, end, k] covering
    1..max(max_num_seqs, largest measured c). A batch size between two measured concurrencies
    takes the k of the nearer one in log scale; equal neighbours merge."""
    require(bool(choice), "choice", "needs at least one concurrency")
    cs = sorted(choice)
    last = max(cs[-1], max_num_seqs or 0)
    rows: list[list[int]] = []
    for i, c in enumerate(cs):
        start = 1 if i == 0 else rows[-1][1] + 1
        # c_i <= floor(sqrt(c_i * c_(i+1))) < c_(i+1): every measured c keeps its own k
        end = last if i == len(cs) - 1 else math.floor(math.sqrt(c * cs[i + 1]))
        if rows and rows[-1][2] == choice[c]:
            rows[-1][1] = end
        else:
            rows.append([start, end, choice[c]])
    return rows


def vllm_fixed_config(draft: str, k: int) -> dict | None:
    """`--speculative-config` for a fixed k; None = serve without speculation (vLLM requires
    num_speculative_tokens > 0, so k = 0 means: leave the option out)."""
    if k == 0:
        return None
    return {"method": "dflash", "model": draft, "num_speculative_tokens": k}


def vllm_table_config(draft: str, choice: dict[int, int],
                      max_num_seqs: int | None = None) -> dict | None:
    """`--speculative-config` with the per-batch-size table (vLLM >= 0.26): num_speculative_tokens
    is the largest k of the table (the engine clamps each entry to it). None when every k is 0.
    A table k of 0 still runs the drafter's context pass each step (vLLM keeps its KV cache in
    sync), and the table turns full CUDA graphs into piecewise ones (vLLM's config override):
    measure the table config itself before trusting it over a fixed k."""
    top = max(choice.values(), default=0)
    if top == 0:
        return None
    if len(set(choice.values())) == 1:
        return vllm_fixed_config(draft, top)
    return {**vllm_fixed_config(draft, top),
            "num_speculative_tokens_per_batch_size": batch_size_table(choice, max_num_seqs)}


def sglang_args(draft: str, k: int, max_running_requests: int | None = None) -> list[str]:
    """SGLang launch args for a fixed k (verify window k + 1, `--speculative-num-draft-tokens`);
    [] = no speculation. DFLASH caps running requests at 48 unless set, so pass the concurrency
    you serve when it is larger."""
    if k == 0:
        return []
    args = ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", draft,
            "--speculative-num-draft-tokens", str(k + 1)]
    if max_running_requests is not None and max_running_requests > 48:
        args += ["--max-running-requests", str(max_running_requests)]
    return args


def report(cells: list[Cell], *, engine: str, draft: str, target_concurrency: int | None = None,
           min_gain: float = 0.02, max_num_seqs: int | None = None) -> dict:
    """The JSON `dflash tune` writes: measured cells, the choice per concurrency with its gain
    over plain, and the engine config for `target_concurrency` (default: the largest measured,
    the load where speculation pays least) plus, for vLLM, the per-batch-size table."""
    require(engine in ("vllm", "sglang"), "engine", f"must be vllm or sglang, got {engine!r}")
    rows = by_concurrency(cells)
    choice = choose(cells, min_gain)
    target = max(choice) if target_concurrency is None else target_concurrency
    require(target >= 1, "--target-concurrency", f"must be >= 1, got {target}")
    # the k for the target: that of the largest measured concurrency <= target (else smallest)
    below = [c for c in choice if c <= target]
    k_target = choice[max(below) if below else min(choice)]
    per_c = {}
    for c, row in rows.items():
        k = choice[c]
        plain = row.get(0)
        gain = (row[k].tokens_per_s / plain.tokens_per_s if plain and plain.tokens_per_s
                else None)
        per_c[str(c)] = {"k": k, "tokens_per_s": row[k].tokens_per_s, "vs_plain": gain,
                         "model_k": model_k(row)}
    out = {"kind": "dflash-tune", "engine": engine, "draft": draft, "min_gain": min_gain,
           "cells": [asdict(c) for c in sorted(cells, key=lambda c: (c.concurrency, c.k))],
           "choice": per_c, "target_concurrency": target, "target_k": k_target}
    if engine == "vllm":
        fixed = vllm_fixed_config(draft, k_target)
        out["vllm"] = {
            "speculative_config": fixed,
            "speculative_config_table": vllm_table_config(draft, choice, max_num_seqs),
            "note": ("no speculation: serve without --speculative-config" if fixed is None
                     else f"--speculative-config for {target} concurrent requests")}
    else:
        max_running = max(max(choice), target)
        out["sglang"] = {"args": sglang_args(draft, k_target, max_running),
                         "per_concurrency": {str(c): sglang_args(draft, k, max(c, target))
                                             for c, k in choice.items()},
                         "note": ("no speculation: launch without --speculative-* args"
                                  if k_target == 0 else
                                  f"launch args for {target} concurrent requests; SGLang has "
                                  "no per-batch-size k for DFLASH")}
    return out



def acceptance(before: dict, after: dict) -> dict:
    """tau, survival and rounds from two snapshots of an engine's speculative counters
    {"num_drafts", "num_accepted_tokens", "accepted_per_pos": [..]} (deltas; vLLM's names
    without the `vllm:spec_decode_` prefix). No rounds in between: tau None, survival []."""
    rounds = after.get("num_drafts", 0) - before.get("num_drafts", 0)
    if rounds <= 0:
        return {"tau": None, "survival": [], "rounds": 0}
    acc = after.get("num_accepted_tokens", 0) - before.get("num_accepted_tokens", 0)
    pos_after, pos_before = after.get("accepted_per_pos", []), before.get("accepted_per_pos", [])
    pos_before = list(pos_before) + [0] * (len(pos_after) - len(pos_before))
    return {"tau": 1 + acc / rounds, "rounds": rounds,
            "survival": [(a - b) / rounds for a, b in zip(pos_after, pos_before)]}


# --- the `dflash tune` command: arguments, validated before any engine starts ---------------

@dataclass(frozen=True)
class TuneRequest:
    engine: str  # "vllm" | "sglang"
    target: str
    draft: str
    block_size: int  # the drafter's (config.json)
    prompts: list[str]
    candidates: list[int]
    concurrency: list[int]
    max_new_tokens: int
    waves: int
    min_requests: int
    warmup_tokens: int
    temperature: float
    min_gain: float
    target_concurrency: int | None
    check_table: bool
    out: str | None
    engine_options: dict  # dtype, max_model_len, seed, enforce_eager, extra (engine kwargs)


def add_parser(sub) -> argparse.ArgumentParser:
    t = sub.add_parser("tune", help="measure k drafted tokens per concurrency in vLLM / SGLang "
                       "and write the engine config", description=__doc__)
    t.add_argument("--engine", required=True, help="vllm or sglang")
    t.add_argument("--target", required=True, help="Hugging Face target model folder")
    t.add_argument("--draft", required=True, help="DFlash drafter folder (z-lab format)")
    t.add_argument("--prompts", required=True, help="JSONL file, one {\"prompt\": ...} a line")
    t.add_argument("--concurrency", default="1,4,8,16,32,64",
                   help="concurrent requests to measure, comma-separated")
    t.add_argument("--candidates", default=None,
                   help="k values to measure (0 = no speculation); default 0,3,7,block-1")
    t.add_argument("--max-new-tokens", type=int, default=128)
    t.add_argument("--waves", type=int, default=16,
                   help="requests per cell: max(waves x concurrency, --min-requests); each "
                        "cell is one closed loop that drains at its end, and speculation's "
                        "requests finish at different steps, so few waves under-fill its "
                        "batches (default 16; 2 until 2026-12-06)")
    t.add_argument("--min-requests", type=int, default=16,
                   help="at least this many requests (prompts cycled) per cell")
    t.add_argument("--warmup-tokens", type=int, default=8)
    t.add_argument("--temperature", type=float, default=0.0)
    t.add_argument("--min-gain", type=float, default=0.02,
                   help="a k > 0 is chosen only if it beats plain by this fraction")
    t.add_argument("--target-concurrency", type=int, default=None,
                   help="the load the fixed config is for (default: the largest measured)")
    t.add_argument("--check-table", action="store_true",
                   help="vLLM: also start the per-batch-size table config and measure it")
    t.add_argument("--dtype", default="auto")
    t.add_argument("--max-model-len", type=int, default=2048)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--enforce-eager", action="store_true")
    t.add_argument("--engine-args", default=None,
                   help='extra engine keyword arguments as JSON, e.g. \'{"gpu_memory_utilization": '
                   '0.8}\' (vllm.LLM / sglang.Engine)')
    t.add_argument("--out", default=None, help="also write the JSON report here")
    return t


def drafter_block_size(draft: str) -> int:
    path = Path(draft) / "config.json"
    require(path.is_file(), "--draft", f"no config.json in {draft}")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError("--draft", f"{path} is not valid JSON ({err.msg})") from None
    block = cfg.get("block_size")
    require(isinstance(block, int) and block >= 2, "--draft",
            f"{path}: block_size must be an integer >= 2, got {block!r}")
    return block


def request_from_args(args) -> TuneRequest:
    """Every argument checked (ConfigError naming the flag and its range), nothing started."""
    from .training.data import load_prompts_jsonl

    require(args.engine in ("vllm", "sglang"), "--engine",
            f"must be vllm or sglang, got {args.engine!r}")
    require((Path(args.target) / "config.json").is_file(), "--target",
            f"no config.json in {args.target}")
    block = drafter_block_size(args.draft)
    if args.candidates is None:
        candidates = sorted({0, min(3, block - 1), min(7, block - 1), block - 1})
    else:
        candidates = validate_candidates(parse_int_list(args.candidates, "--candidates", 0),
                                         block)
    conc = parse_int_list(args.concurrency, "--concurrency", 1, 4096)
    for name, val, lo in (("--max-new-tokens", args.max_new_tokens, 1), ("--waves", args.waves, 1),
                          ("--min-requests", args.min_requests, 1),
                          ("--warmup-tokens", args.warmup_tokens, 1),
                          ("--max-model-len", args.max_model_len, 16)):
        require(val >= lo, name, f"must be >= {lo}, got {val}")
    require(args.max_new_tokens + block + 16 <= args.max_model_len, "--max-new-tokens",
            f"must leave room for a prompt in --max-model-len {args.max_model_len} (<= "
            f"{args.max_model_len - block - 16}), got {args.max_new_tokens}")
    require(0 <= args.temperature <= 2, "--temperature", f"must be in [0, 2], got "
            f"{args.temperature}")
    require(0 <= args.min_gain < 1, "--min-gain", f"must be in [0, 1), got {args.min_gain}")
    require(args.target_concurrency is None or args.target_concurrency >= 1,
            "--target-concurrency", f"must be >= 1, got {args.target_concurrency}")
    extra = {}
    if args.engine_args:
        try:
            extra = json.loads(args.engine_args)
        except json.JSONDecodeError as err:
            raise ConfigError("--engine-args", f"is not valid JSON ({err.msg})") from None
        require(isinstance(extra, dict), "--engine-args", f"must be a JSON object, got {extra!r}")
    return TuneRequest(
        engine=args.engine, target=args.target, draft=args.draft, block_size=block,
        prompts=load_prompts_jsonl(args.prompts), candidates=candidates, concurrency=conc,
        max_new_tokens=args.max_new_tokens, waves=args.waves,
        min_requests=args.min_requests, warmup_tokens=args.warmup_tokens,
        temperature=args.temperature, min_gain=args.min_gain,
        target_concurrency=args.target_concurrency, check_table=args.check_table, out=args.out,
        engine_options={"dtype": args.dtype, "max_model_len": args.max_model_len,
                        "seed": args.seed, "enforce_eager": args.enforce_eager, "extra": extra})


def write_report(doc: dict, out: str | None) -> str:
    text = json.dumps(doc, indent=1)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
    return text
