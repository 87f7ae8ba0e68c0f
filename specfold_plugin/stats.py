"""Fold counters and projected FLOPs of SpecFold verification.

A *row* is one (branch, position) of a verification forward in one layer. Per layer, the QKV set
and the FFN set are the rows recomputed by the attention gate and the FFN gate; all other rows are
folded. Root rows are never folded, so ratios are also given over draft rows only.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class FoldStats:
    layers: int
    forwards: int = 0
    rows: int = 0  # rows per layer, summed over forwards
    root_rows: int = 0
    qkv_rows: list[int] = field(default_factory=list)  # [layers] recomputed rows, summed
    ffn_rows: list[int] = field(default_factory=list)  # [layers]
    prefix_qk_dense: int = 0  # sum over forwards of rows x committed-context length
    prefix_qk_folded: int = 0  # sum over forwards and layers of recomputed QKV rows x context
    reruns: int = 0  # backend "triton": layers re-run because a capacity plan was too small

    def __post_init__(self):
        self.qkv_rows = self.qkv_rows or [0] * self.layers
        self.ffn_rows = self.ffn_rows or [0] * self.layers

    def add_forward(self, rows: int, root_rows: int, context: int) -> None:
        self.forwards += 1
        self.rows += rows
        self.root_rows += root_rows
        self.prefix_qk_dense += rows * context

    def add_layer(self, layer: int, qkv: int, ffn: int, context: int) -> None:
        self.qkv_rows[layer] += qkv
        self.ffn_rows[layer] += ffn
        self.prefix_qk_folded += qkv * context

    def merge(self, other: FoldStats) -> None:
        """Add another run's counters (same model) to these."""
        self.forwards += other.forwards
        self.rows += other.rows
        self.root_rows += other.root_rows
        self.prefix_qk_dense += other.prefix_qk_dense
        self.prefix_qk_folded += other.prefix_qk_folded
        self.reruns += other.reruns
        self.qkv_rows = [a + b for a, b in zip(self.qkv_rows, other.qkv_rows)]
        self.ffn_rows = [a + b for a, b in zip(self.ffn_rows, other.ffn_rows)]

    def fold_ratio(self, part: str = "qkv", drafts_only: bool = False) -> float:
        """Share of rows folded by the `part` ("qkv" or "ffn") gate, over all layers."""
        done = sum(self.qkv_rows if part == "qkv" else self.ffn_rows)
        total = self.rows * self.layers
        if drafts_only:
            done -= self.root_rows * self.layers
            total -= self.root_rows * self.layers
        return 1.0 - done / total if total else 0.0

    def per_layer(self, part: str = "qkv") -> list[float]:
        rows = self.qkv_rows if part == "qkv" else self.ffn_rows
        return [round(1.0 - r / self.rows, 4) if self.rows else 0.0 for r in rows]

    def summary(self) -> dict:
        return {"forwards": self.forwards, "rows_per_layer": self.rows,
                "fold_qkv": round(self.fold_ratio("qkv"), 4),
                "fold_ffn": round(self.fold_ratio("ffn"), 4),
                "fold_qkv_drafts": round(self.fold_ratio("qkv", True), 4),
                "fold_ffn_drafts": round(self.fold_ratio("ffn", True), 4),
                "fold_qkv_per_layer": self.per_layer("qkv"),
                "fold_ffn_per_layer": self.per_layer("ffn"), "reruns": self.reruns}


def projected_flops(config, stats: FoldStats, block_size: int) -> dict:
    """Matmul FLOPs (2 per multiply-add) of the dense and the folded verification forwards that
    `stats` counted: QKV and FFN on their recompute sets, o_proj and the LM head on every row,
    attention over the committed context for recomputed query rows only, over the own block for
    every row. Gates, gathers and norms are left out (O(rows x hidden))."""
    d, heads, kvh = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    hd = getattr(config, "head_dim", None) or d // heads
    qkv = 2 * d * (heads + 2 * kvh) * hd
    o = 2 * heads * hd * d
    ffn = 2 * 3 * d * config.intermediate_size
    att = 4 * heads * hd  # QK^T and PV per (query, key)
    layers, rows = stats.layers, stats.rows
    head = 2 * d * config.vocab_size * rows
    common = layers * rows * (o + att * block_size) + head
    dense = common + layers * (rows * (qkv + ffn) + att * stats.prefix_qk_dense)
    folded = (common + qkv * sum(stats.qkv_rows) + ffn * sum(stats.ffn_rows)
              + att * stats.prefix_qk_folded)
    return {"dense": dense, "folded": folded,
            "saving": round(1 - folded / dense, 4) if dense else 0.0}
