"""Prompt-lookup (n-gram) drafting: the training-free baseline.

The proposer looks for the most recent earlier occurrence of the row's last n tokens (n from
`max_ngram` down to `min_ngram`) in its own history (prompt + generated) and proposes the tokens
that followed it. With no match it proposes a copy of the last token (almost always rejected).
"""

from __future__ import annotations

import torch


def ngram_lookup(history: list[int], g: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to g tokens following the latest earlier match of the longest suffix n-gram."""
    for n in range(max_ngram, min_ngram - 1, -1):
        if len(history) <= n:
            continue
        suffix = history[-n:]
        for start in range(len(history) - n - 1, -1, -1):
            if history[start:start + n] == suffix:
                return history[start + n:start + n + g]
    return []


class NgramProposer:
    layer_ids: tuple[int, ...] = ()

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.history: list[list[int]] = []

    def start(self, runner, ids, features, positions, valid):
        self.history = [row[mask].tolist() for row, mask in zip(ids, valid)]

    def propose(self, anchor_ids, anchor_pos, g, params, generator):
        out = []
        for hist, anchor in zip(self.history, anchor_ids.tolist()):
            cont = ngram_lookup(hist + [anchor], g, self.max_ngram, self.min_ngram)
            out.append(cont + [cont[-1] if cont else anchor] * (g - len(cont)))
        return torch.tensor(out, dtype=torch.long, device=anchor_ids.device), None

    def observe(self, ids, features, positions, keep):
        for hist, row, mask in zip(self.history, ids, keep):
            hist.extend(row[mask].tolist())

    def select_rows(self, rows):
        self.history = [self.history[i] for i in rows.tolist()]
