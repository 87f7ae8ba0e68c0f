"""The adaptive server's launch ledger interval by interval, from its log. DFLASH_ADAPTIVE logs
every 200 decode steps (`DFLASH_ADAPTIVE_LOG_EVERY`) the ledger summed since the server started
(`adaptive.LaunchLedger.summary`); a server that runs a row per concurrency mixes them all in its
last line. The difference of two consecutive lines gives what happened in between: the mean
requests per decode launch, the wall time per decode launch (the intervals after it, prefill
passes included), the prefill passes and their requests per pass. Lines since 2026-12-06
carry the ledger's sums; in older ones the sums come back from the rounded means and the
intervals' counts (a decode launch after an idle gap or the server's last is not counted), so
their requests per decode launch are good to a few percent.

    python benchmarks/ledger_intervals.py benchmarks/results/gpu-engines/h100-2026-12-06h/*.log.gz
"""

from __future__ import annotations

import argparse
import ast
import gzip
import re

LINE = re.compile(r"\[(?P<time>[^\]]+)\] DFLASH_ADAPTIVE: (?P<steps>\d+) decode steps.*"
                  r"launches (?P<ledger>\{.*\}); ")


def parse(line: str) -> dict | None:
    """One log line's time, decode steps and ledger sums (None for any other line)."""
    m = LINE.search(line)
    if not m:
        return None
    led = ast.literal_eval(m["ledger"])
    kinds = {k: led[k] for k in ("dd", "dp", "p.")}
    sums = led.get("sums") or {  # older lines: a decode launch is followed by 'dd' or 'dp'
        "decodes": kinds["dd"]["n"] + kinds["dp"]["n"],
        "rows": (led["per_decode"] or 0) * (kinds["dd"]["n"] + kinds["dp"]["n"]),
        "admitted": (led["per_prefill"] or 0) * kinds["p."]["n"]}
    return {"time": m["time"], "steps": int(m["steps"]), **sums, "passes": kinds["p."]["n"],
            "ms": sum(v["n"] * (v["ms"] or 0) for v in kinds.values())}


def intervals(sums: list[dict]) -> list[dict]:
    """Per pair of consecutive sums: decode launches, mean requests per decode launch, wall ms per
    decode launch, prefill passes and requests per pass."""
    out = []
    for a, b in zip(sums, sums[1:]):
        d, p = b["decodes"] - a["decodes"], b["passes"] - a["passes"]
        out.append({"time": b["time"], "steps": b["steps"], "decodes": d,
                    "per_decode": (b["rows"] - a["rows"]) / d if d else None,
                    "ms_per_decode": (b["ms"] - a["ms"]) / d if d else None,
                    "passes": p, "per_prefill": (b["admitted"] - a["admitted"]) / p if p else None})
    return out


def read(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", errors="replace") as f:
        return [s for s in map(parse, f) if s]


def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", nargs="+", help="server logs (.gz read as such)")
    for path in ap.parse_args().logs:
        print(f"{path}\n| time | decode steps | requests per decode | ms per decode (wall) | "
              f"prefill passes | requests per pass |\n|---|---|---|---|---|---|")
        for r in intervals(read(path)):
            print(f"| {r['time']} | {r['steps']} | {fmt(r['per_decode'], '.1f')} | "
                  f"{fmt(r['ms_per_decode'], '.2f')} | {r['passes']} | "
                  f"{fmt(r['per_prefill'], '.1f')} |")


if __name__ == "__main__":
    main()
