"""The report of `gpu_speedup.py` from its results.json: the markdown table (`markdown`: timed
rows, cold first-request latency, bf16 identity) and the speed-up plot (tokens/s per batch size,
tau per row; matplotlib where it is importable, else a plain PIL drawing).

    python benchmarks/gpu_speedup.py --plot DIR/results.json    # writes DIR/speedup.png
"""

from __future__ import annotations

import json
import math
from pathlib import Path

COLORS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189)]


def series(R: dict):
    """{label: [(batch, speedup)]} and {label: sorted tau per prompt at batch 1}."""
    base = {r["batch"]: r["tokens_per_second"] for r in R["rows"] if r["row"] == "ours AR"}
    speed, taus = {}, {}
    for r in R["rows"]:
        if r["row"] in ("ours DFlash", "ours n-gram (host lookup)") and r["batch"] in base:
            label = f"{r['row'].split(' (')[0]} B={r['block']}"
            speed.setdefault(label, []).append((r["batch"],
                                                r["tokens_per_second"] / base[r["batch"]]))
            if r["batch"] == 1 and r.get("tau_per_prompt"):
                taus[label] = sorted(r["tau_per_prompt"])
    return speed, taus


def _plot_mpl(speed, taus, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for label, pts in speed.items():
        pts = sorted(pts)
        a.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=label)
    a.axhline(1.0, color="gray", lw=0.8)
    a.set_xscale("log", base=2)
    a.set_xlabel("batch size")
    a.set_ylabel("speedup over our AR (tokens/s)")
    a.legend()
    for label, t in taus.items():
        b.plot(range(len(t)), t, marker=".", label=label)
    b.set_xlabel("prompt (sorted by tau)")
    b.set_ylabel("tau (batch 1)")
    b.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def _plot_pil(speed, taus, png):
    from PIL import Image, ImageDraw

    W, H, M = 1100, 420, 50
    img = Image.new("RGB", (W, H), "white")
    d = ImageDraw.Draw(img)

    def panel(x0, title, pts_by_label, xs_log):
        x1, y0, y1 = x0 + W // 2 - 2 * M, M, H - M
        allp = [p for pts in pts_by_label.values() for p in pts] or [(1, 1)]
        xv = [(p[0] if not xs_log else math.log2(p[0])) for p in allp]
        ymax = max(max(p[1] for p in allp), 1.0) * 1.1
        xmin, xmax = min(xv), max(max(xv), min(xv) + 1)
        d.rectangle([x0, y0, x1, y1], outline="black")
        d.text((x0, 10), title, fill="black")
        for k in range(5):
            yv = ymax * k / 4
            yy = y1 - (y1 - y0) * yv / ymax
            d.text((x0 - 40, yy - 5), f"{yv:.1f}", fill="black")
        for i, (label, pts) in enumerate(pts_by_label.items()):
            c = COLORS[i % len(COLORS)]
            xy = []
            for x, y in sorted(pts):
                xx = math.log2(x) if xs_log else x
                xy.append((x0 + (x1 - x0) * (xx - xmin) / (xmax - xmin), y1 - (y1 - y0) * y / ymax))
            if len(xy) > 1:
                d.line(xy, fill=c, width=2)
            for px, py in xy:
                d.ellipse([px - 3, py - 3, px + 3, py + 3], fill=c)
            d.text((x0 + 10, y0 + 10 + 14 * i), label, fill=c)
        if xs_log:
            for x in sorted({p[0] for p in allp}):
                xx = x0 + (x1 - x0) * (math.log2(x) - xmin) / (xmax - xmin)
                d.text((xx - 5, y1 + 5), str(x), fill="black")

    panel(M + 10, "speedup over our AR vs batch size", speed, True)
    panel(W // 2 + M + 10, "tau per prompt at batch 1 (sorted)",
          {k: list(enumerate(v)) for k, v in taus.items()}, False)
    img.save(png)


def _baseline(R: dict, r: dict):
    """The AR row a row's speedup is measured against: the same group (warm / slow-row
    prompts / a batch size)."""
    for tag in ("(warm)", "(slow"):
        if tag in r["row"]:
            return next((a["tokens_per_second"] for a in R["rows"]
                         if a["row"].startswith("ours AR") and tag in a["row"]), None)
    return next((a["tokens_per_second"] for a in R["rows"]
                 if a["row"] == "ours AR" and a["batch"] == r["batch"]), None)


def markdown(R: dict) -> str:
    lines = ["| row | batch | B | prompts | tok/s | tau | speedup vs our AR | draft / verify / "
             "overhead (s) |", "|---|---|---|---|---|---|---|---|"]
    for r in R["rows"]:
        ref = _baseline(R, r)
        sp = f"{r['tokens_per_second'] / ref:.2f}" if ref else "-"
        s = r.get("split_seconds")
        split = f"{s['draft']:.3f} / {s['verify']:.3f} / {s['overhead']:.3f}" if s else "-"
        lines.append(f"| {r['row']} | {r['batch']} | {r['block']} | {r['prompts']} | "
                     f"{r['tokens_per_second']:.1f} | {r.get('tau', 1.0):.3f} | {sp} | {split} |")
    if R.get("cold"):
        lines += ["", "Cold (batch 1, fresh process and compile caches): seconds per request",
                  "", "| proposer | prefill_bucket | startup warmup() | first request | "
                  "new prompt length (median) | same prompts again (median) |",
                  "|---|---|---|---|---|---|"]
        for c in R["cold"]:
            if "error" in c:
                lines.append(f"| {c['proposer']} | {c['bucket']} | error: {c['error'][:80]} "
                             "| | | |")
                continue
            med = [f"{c[k]:.3f}" if c[k] is not None else "-"
                   for k in ("new_length_median_s", "repeat_median_s")]
            lines.append(f"| {c['name']} | {c['bucket']} | {c['startup_s']:.2f} | "
                         f"{c['first_request_s']:.3f} | {med[0]} | {med[1]} |")
    ident = R.get("checks", {}).get("bf16_identity")
    if ident:
        keys = sorted({k for v in ident.values() if isinstance(v, dict) for k in v
                       if k.endswith(" vs ar")})
        lines += ["", "Identity with plain decoding (same runtime, batch 1): identical / prompts",
                  "", "| invariant | " + " | ".join(keys) + " |",
                  "|---|" + "---|" * len(keys)]
        for name, v in ident.items():
            cells = [f"{v[k]['identical']} / {v[k]['of']}" if k in v else
                     str(v.get("skipped", "-")) for k in keys]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(results_json, png) -> Path:
    R = json.loads(Path(results_json).read_text())
    speed, taus = series(R)
    try:
        _plot_mpl(speed, taus, png)
    except ImportError:
        _plot_pil(speed, taus, png)
    return Path(png)

