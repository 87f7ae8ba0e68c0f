"""Read the stack samples of `benchmarks/stack_sampler` (DIR/<pid>.txt): per label, the busiest
thread whose stacks pass through FOCUS (default SGLang's scheduler loop), its call tree from
the first FOCUS frame down (shares of that thread's sampled wall time, nodes at >=
--min-share), and the leaf frames (self time) with the largest shares.

    python benchmarks/stack_report.py /tmp/res/stacks/adaptive-q1 [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path


def load(directory: Path) -> dict:
    """{(label, pid, thread): Counter(stack tuple -> sampled microseconds)}."""
    runs: dict = collections.defaultdict(collections.Counter)
    for path in sorted(directory.glob("*.txt")):
        for line in path.read_text().splitlines():
            n, label, thread, stack = line.split("\t", 3)
            runs[(label, path.stem, thread)][tuple(stack.split(";"))] += int(n)
    return runs


def from_focus(stacks: collections.Counter, focus: str) -> collections.Counter:
    """The stacks that pass through `focus`, cut to start at its first frame."""
    cut: collections.Counter = collections.Counter()
    for stack, n in stacks.items():
        i = next((j for j, f in enumerate(stack) if focus in f), None)
        if i is not None:
            cut[stack[i:]] += n
    return cut


def call_tree(stacks: collections.Counter, min_share: float, max_depth: int) -> list[dict]:
    """Depth-first rows {depth, frame, share} of the tree of `stacks`, children by share."""
    total = sum(stacks.values())
    rows: list[dict] = []

    def visit(prefix: tuple, depth: int) -> None:
        kids: collections.Counter = collections.Counter()
        for stack, n in stacks.items():
            if len(stack) > len(prefix) and stack[:len(prefix)] == prefix:
                kids[stack[len(prefix)]] += n
        for frame, n in kids.most_common():
            if n / total < min_share:
                break
            rows.append({"depth": depth, "frame": frame, "share": n / total})
            if depth < max_depth:
                visit(prefix + (frame,), depth + 1)

    visit((), 0)
    return rows


def leaves(stacks: collections.Counter, top: int) -> list[dict]:
    total = sum(stacks.values())
    own: collections.Counter = collections.Counter()
    for stack, n in stacks.items():
        own[stack[-1]] += n
    return [{"frame": f, "share": n / total} for f, n in own.most_common(top)]


def report(directory: Path, focus: str, min_share: float, max_depth: int, top: int) -> dict:
    runs = load(directory)
    best: dict = {}
    for (label, pid, thread), stacks in runs.items():
        cut = from_focus(stacks, focus)
        if cut and sum(cut.values()) > sum(best.get(label, (None, collections.Counter()))[1]
                                           .values()):
            best[label] = (f"{pid}/{thread}", cut)
    doc = {}
    for label, (who, cut) in sorted(best.items()):
        doc[label] = {"thread": who, "seconds": sum(cut.values()) / 1e6,
                      "tree": call_tree(cut, min_share, max_depth),
                      "leaves": leaves(cut, top)}
    return doc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--focus", default="scheduler.py:Scheduler.event_loop")
    ap.add_argument("--min-share", type=float, default=0.01)
    ap.add_argument("--max-depth", type=int, default=12)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    doc = report(args.dir, args.focus, args.min_share, args.max_depth, args.top)
    for label, d in doc.items():
        print(f"== {label}: {d['thread']}, {d['seconds']:.2f} s sampled")
        for r in d["tree"]:
            print(f"{100 * r['share']:5.1f}% {'  ' * r['depth']}{r['frame']}")
        print("-- self")
        for r in d["leaves"]:
            print(f"{100 * r['share']:5.1f}% {r['frame']}")
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
