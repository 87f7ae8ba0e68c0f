"""Draft graphs of Spiffy.

Ranks come from the distribution P that produced the *root* (the state after the current step):
a *pair* (i, j) unmasks the root's masked position of confidence rank i under P with that
position's token of probability rank j under P. A *node* is a guessed future state: the pairs
applied on top of the root after `depth` more denoising steps. A is a *parent* of B iff
depth(B) = depth(A) + 1 and pairs(A) is a strict subset of pairs(B); a node may have several
parents; depth-1 nodes hang off the root. Graph files are JSON (`FORMAT`, `VERSION` below); the
optional field "selection" names the rule that chose the nodes (absent = accumulated frequency).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError, require

FORMAT = "spiffy-draft-graph"
VERSION = 1

Pair = tuple[int, int]


@dataclass(frozen=True, order=True)
class Node:
    depth: int
    pairs: tuple[Pair, ...]  # sorted

    @staticmethod
    def of(pairs, depth: int) -> Node:
        return Node(depth, tuple(sorted(set(map(tuple, pairs)))))


def is_parent(a: Node, b: Node) -> bool:
    return b.depth == a.depth + 1 and set(a.pairs) < set(b.pairs)


def parents_in(node: Node, nodes) -> list[Node]:
    return [a for a in nodes if is_parent(a, node)]


def select_graph(counts: dict[Node, int], budget: int) -> list[Node]:
    """Greedy connected subgraph of `budget` nodes maximising the degree-1 accumulated
    frequency: score(n) = count(n) + sum of its parents' counts. Every chosen node is at depth 1
    or has a chosen parent. Ties break on (depth, pairs) so the result is deterministic."""
    require(budget >= 1, "budget", f"must be >= 1, got {budget}")
    score = {n: c + sum(counts[p] for p in parents_in(n, counts)) for n, c in counts.items()}
    chosen: list[Node] = []
    while len(chosen) < budget:
        frontier = [n for n in counts if n not in chosen
                    and (n.depth == 1 or any(is_parent(p, n) for p in chosen))]
        if not frontier:
            break
        chosen.append(min(frontier, key=lambda n: (-score[n], n)))
    return chosen


def accepted_depth(chain: list[Node], chosen: set[Node]) -> int:
    """Steps a graph saves on one calibration sample: the true nodes of the next 1, 2, ... steps
    (`chain`, each the parent of the next) are accepted while they are all in the graph."""
    k = 0
    while k < len(chain) and chain[k] in chosen:
        k += 1
    return k


def select_by_depth(chains: list[list[Node]], budget: int) -> list[Node]:
    """Greedy connected subgraph of `budget` nodes maximising the expected accepted depth on the
    calibration samples (sum of `accepted_depth` over `chains`). A node is added only as the
    first missing node of some chain whose earlier nodes are all chosen, so the result is
    connected; its gain counts the chosen nodes it makes reachable too. Ties break on
    (depth, pairs)."""
    require(budget >= 1, "budget", f"must be >= 1, got {budget}")
    chosen: list[Node] = []
    have: set[Node] = set()
    while len(chosen) < budget:
        gain: dict[Node, int] = {}
        for chain in chains:
            k = accepted_depth(chain, have)
            if k < len(chain):
                gain[chain[k]] = gain.get(chain[k], 0) + 1 + accepted_depth(chain[k + 1:], have)
        if not gain:
            break
        best = min(gain, key=lambda n: (-gain[n], n))
        chosen.append(best)
        have.add(best)
    return chosen


SELECTIONS = ("expected-depth", "accumulated-frequency")


def check_selection(selection: str) -> None:
    require(selection in SELECTIONS, "selection", f"must be one of {SELECTIONS}, got "
            f"{selection!r}")


@dataclass(frozen=True)
class DraftGraph:
    nodes: tuple[Node, ...]
    counts: tuple[int, ...]
    block_size: int
    vocab_size: int
    rule: str  # the decoding rule it was calibrated under, e.g. "vanilla-1", "threshold-0.9"
    selection: str = "accumulated-frequency"  # how the nodes were chosen (SELECTIONS)

    def children(self, parent: Node | None) -> list[int]:
        """Indices of the nodes one step below `parent` (None = the root)."""
        if parent is None:
            return [k for k, n in enumerate(self.nodes) if n.depth == 1]
        return [k for k, n in enumerate(self.nodes) if is_parent(parent, n)]

    def check_model(self, block_size: int, vocab_size: int) -> None:
        require(self.block_size == block_size, "graph.block_size",
                f"graph was calibrated for blocks of {self.block_size}, the model uses "
                f"{block_size}")
        require(self.vocab_size == vocab_size, "graph.vocab_size",
                f"graph was calibrated for a vocabulary of {self.vocab_size}, the model has "
                f"{vocab_size}")

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "block_size": self.block_size,
                "vocab_size": self.vocab_size, "rule": self.rule, "selection": self.selection,
                "nodes": [{"depth": n.depth, "pairs": [list(p) for p in n.pairs], "count": c}
                          for n, c in zip(self.nodes, self.counts)]}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")


def load_graph(path: str | Path) -> DraftGraph:
    path = Path(path)
    require(path.is_file(), "graph", f"file not found: {path}")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError("graph", f"{path} is not valid JSON ({err.msg})") from None
    require(raw.get("format") == FORMAT, "graph.format", f"expected {FORMAT!r}, got "
            f"{raw.get('format')!r}")
    require(raw.get("version") == VERSION, "graph.version",
            f"version {raw.get('version')} is not supported (this build reads {VERSION})")
    nodes = tuple(Node.of(n["pairs"], n["depth"]) for n in raw["nodes"])
    return DraftGraph(nodes, tuple(n.get("count", 0) for n in raw["nodes"]), raw["block_size"],
                      raw["vocab_size"], raw.get("rule", "vanilla-1"),
                      raw.get("selection", "accumulated-frequency"))


def geometric_mean(values: list[float]) -> float:
    return math.exp(sum(math.log(max(v, 1e-30)) for v in values) / len(values))
