"""What `gpu_adaptive_sglang.py` measures beside its rows, on one started `sglang.Engine`: a
moving load (`trace_phase`, `trace_report`) and the sampled decode steps (`profile_mode`, with
`benchmarks/stack_sampler` loaded into the engine's processes) split into the parts of SGLang's
scheduler loop (`PARTS`, `breakdown`)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


def trace_phase(engine, ids: list[list[int]], c: int, n: int, max_tokens: int) -> dict:
    """n requests (prompts cycled), c at a time, on a started server: tokens/s and SGLang's
    verify rounds (None without speculation). A phase of a moving load, or a profiled row."""
    from dflash_plugin.engines.sglang_tune import closed_loop

    batch = [ids[i % len(ids)] for i in range(n)]
    t0 = time.perf_counter()
    done = closed_loop(engine, batch, max_tokens, c)
    dt = time.perf_counter() - t0
    ntok = sum(len(d.token_ids) for d in done)
    rounds = [d.verify_rounds for d in done]
    print(f"c={c} n={n}: {ntok / dt:.1f} tok/s", flush=True)
    return {"concurrency": c, "requests": n, "tokens": ntok, "seconds": dt,
            "tokens_per_s": ntok / dt, "verify_rounds": sum(rounds) if all(rounds) else None}


def trace_report(docs: dict) -> None:
    """The moving load per mode: each phase's tokens/s, the whole trace's, and the best
    single server (plain or DFLASH for the whole trace) beside the per-phase best."""
    runs = {m: d["trace"] for m, d in docs.items() if d.get("trace")}
    if not runs:
        return
    phases = next(iter(runs.values()))
    print("| mode | " + " | ".join(f"c={p['concurrency']} x {p['requests']}" for p in phases)
          + " | trace tok/s |")
    print("|---" * (len(phases) + 2) + "|")
    total = {}
    for m, tr in runs.items():
        total[m] = sum(p["tokens"] for p in tr) / sum(p["seconds"] for p in tr)
        print(f"| {m} | " + " | ".join(f"{p['tokens_per_s']:.0f}" for p in tr)
              + f" | {total[m]:.0f} |")
    if {"plain", "dflash"} <= set(total):
        static = max(total["plain"], total["dflash"])
        best = sum(min(a["seconds"], b["seconds"])
                   for a, b in zip(runs["plain"], runs["dflash"]))
        per_phase = sum(p["tokens"] for p in phases) / best
        print(f"best single server {static:.0f} tok/s, per-phase best {per_phase:.0f}")
        if "adaptive" in total:
            print(f"adaptive: {total['adaptive'] / static:.3f}x the best single server, "
                  f"{total['adaptive'] / per_phase:.3f}x the per-phase best")


def profile_mode(engine, ids: list[list[int]], concurrency: list[int], per_slot: int,
                 max_tokens: int) -> list[dict]:
    """Sampled rows of a started engine: per c an untimed pass, then `trace_phase` of
    per_slot x c requests with the sampler's label file (STACK_SAMPLE_DIR/label) set to c."""
    from dflash_plugin.engines.sglang_tune import closed_loop

    label = Path(os.environ["STACK_SAMPLE_DIR"]) / "label"
    rows = []
    for c in concurrency:
        closed_loop(engine, ids[:c], 16, c)
        label.write_text(f"c{c}")
        rows.append(trace_phase(engine, ids, c, per_slot * c, max_tokens))
        label.unlink()
        time.sleep(0.5)  # the sampler writes the finished label out (it looks every 50 ms)
    return rows


# the loop's parts: a sample counts for a part when its stack contains the pattern
PARTS = {
    "loop": "scheduler.py:Scheduler.event_loop",
    "next batch (prepare_for_decode)": "Scheduler.get_next_batch_to_run",
    "run_batch": "Scheduler.run_batch",
    "worker step": "forward_batch_generation",
    "model forwards (target, drafter)": "model_runner.py:ModelRunner.forward",
    "verify inputs (prepare_for_verify)": "DFlashVerifyInput.prepare_for_verify",
    "drafter-KV append": "_append_target_hidden_to_draft_kv_by_loc",
    "noise embedding": ("DFlashWorkerV2.forward_batch_generation;"
                        "modules/module.py:Module._wrapped_call_impl"),
    "result to host (copy_to_cpu)": "GenerationBatchResult.copy_to_cpu",
    "process_batch_result": "Scheduler.process_batch_result",
}


def breakdown(out: Path) -> dict:
    """{mode: {label: {part: ms per decode step}}} from a `profile` run's samples (its
    `stacks/`, or the `stacks.tgz` they were packed into)."""
    import tarfile
    import tempfile

    from stack_report import from_focus, load

    with tempfile.TemporaryDirectory() as tmp:
        stacks_dir = out / "stacks"
        if not stacks_dir.is_dir() and (out / "stacks.tgz").is_file():
            with tarfile.open(out / "stacks.tgz") as tar:
                tar.extractall(tmp, filter="data")
            stacks_dir = Path(tmp) / "stacks"
        runs = {m.name: load(m) for m in stacks_dir.iterdir()} if stacks_dir.is_dir() else {}
    doc: dict = {}
    for path in sorted(out.glob("*-profile.json")):
        prof = json.loads(path.read_text())
        rows = {f"c{r['concurrency']}": r for r in prof["rows"]}
        best: dict = {}
        for (label, _, _), stacks in runs.get(prof["mode"], {}).items():
            cut = from_focus(stacks, PARTS["loop"])
            if label in rows and sum(cut.values()) > sum(best.get(label, {}).values()):
                best[label] = cut
        for label, cut in best.items():
            r = rows[label]
            steps = (r["verify_rounds"] or r["tokens"]) / r["concurrency"]
            cell = {"wall": 1e3 * r["seconds"] / steps}
            for part, pattern in PARTS.items():
                us = sum(n for s, n in cut.items() if pattern in ";".join(s))
                cell[part] = us / 1e3 / steps
            doc.setdefault(prof["mode"], {})[label] = cell
    return doc


def print_breakdown(doc: dict) -> None:
    cols = [(m, c) for m in doc for c in sorted(doc[m], key=lambda x: int(x[1:]))]
    print("| ms per decode step | " + " | ".join(f"{m} {c}" for m, c in cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for part in ["wall"] + list(PARTS):
        print(f"| {part} | " + " | ".join(f"{doc[m][c][part]:.2f}" for m, c in cols) + " |")
