"""Exact-output table for Spiffy's `candidate_mask`: each case spells out the whole visibility
matrix by hand (rows = query tokens of the forward, columns = cached tokens then the forward's
own tokens; 1 = visible). Clean blocks are block-causal, candidate blocks see the cache, every
clean row and their own block, never another candidate."""

from __future__ import annotations

import pytest
import torch

from spiffy_plugin.runtime import candidate_mask


def matrix(rows: list[str]) -> list[list[bool]]:
    """'11|10' -> [True, True, True, False] ('|' and spaces are only for reading)."""
    return [[c == "1" for c in r if c in "01"] for r in rows]


# (name, clean_len, num_blocks, block_size, cached, expected rows "cache | forward tokens")
CASES = [
    ("one_candidate_no_context", 0, 1, 2, 0, [
        "|11",
        "|11"]),
    ("one_candidate_over_cache", 0, 1, 2, 3, [
        "111|11",
        "111|11"]),
    ("zero_candidates_clean_only_is_block_causal", 4, 0, 2, 0, [
        "|11 00",
        "|11 00",
        "|11 11",
        "|11 11"]),
    ("clean_block_then_candidate", 2, 1, 2, 1, [
        "1|11 00",
        "1|11 00",
        "1|11 11",
        "1|11 11"]),
    ("two_candidates_never_see_each_other", 0, 2, 2, 2, [
        "11|11 00",
        "11|11 00",
        "11|00 11",
        "11|00 11"]),
    ("mixed_clean_and_candidates", 2, 2, 2, 0, [
        "|11 00 00",
        "|11 00 00",
        "|11 11 00",
        "|11 11 00",
        "|11 00 11",
        "|11 00 11"]),
    ("two_clean_blocks_and_a_candidate", 4, 1, 2, 1, [
        "1|11 00 00",
        "1|11 00 00",
        "1|11 11 00",
        "1|11 11 00",
        "1|11 11 11",
        "1|11 11 11"]),
    ("block_of_one", 1, 2, 1, 1, [
        "1|1 0 0",
        "1|1 1 0",
        "1|1 0 1"]),
    ("block_of_three_three_candidates", 0, 3, 3, 1, [
        "1|111 000 000",
        "1|111 000 000",
        "1|111 000 000",
        "1|000 111 000",
        "1|000 111 000",
        "1|000 111 000",
        "1|000 000 111",
        "1|000 000 111",
        "1|000 000 111"]),
]


@pytest.mark.parametrize("name,clean_len,num_blocks,block_size,cached,rows", CASES,
                         ids=[c[0] for c in CASES])
def test_candidate_mask_table(name, clean_len, num_blocks, block_size, cached, rows):
    want = matrix(rows)
    q = clean_len + num_blocks * block_size
    got = candidate_mask(clean_len, num_blocks, block_size, cached)
    assert got.dtype == torch.bool
    assert tuple(got.shape) == (q, cached + q) == (len(want), len(want[0]))
    assert got.tolist() == want
