"""Greedy verification on hand-built target logits."""

from __future__ import annotations

import torch

from batchspec.engine.verifier import verify_greedy


def logits_for(argmax_rows: list[list[int]], vocab: int = 10) -> torch.Tensor:
    """``[B, k+1, V]`` logits whose argmax at each position is the given token."""
    out = torch.zeros(len(argmax_rows), len(argmax_rows[0]), vocab)
    for b, row in enumerate(argmax_rows):
        for j, token in enumerate(row):
            out[b, j, token] = 1.0
    return out


def test_longest_matching_prefix_and_bonus():
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3], [4, 2, 3], [1, 5, 3]])
    p = logits_for([[1, 2, 3, 9], [1, 2, 8, 9], [1, 2, 3, 9], [1, 2, 3, 9]])
    verdict = verify_greedy(drafts, p)
    assert verdict.accepted.tolist() == [3, 2, 0, 1]
    assert verdict.gained.tolist() == [4, 3, 1, 2]
    gained = [verdict.tokens[b, : int(n)].tolist() for b, n in enumerate(verdict.gained)]
    # all accepted: the drafts and the bonus; otherwise the accepted prefix and the target's correction
    assert gained == [[1, 2, 3, 9], [1, 2, 8], [1], [1, 2]]


def test_a_later_match_after_a_mismatch_is_not_accepted():
    drafts = torch.tensor([[7, 2, 3]])
    verdict = verify_greedy(drafts, logits_for([[1, 2, 3, 4]]))
    assert verdict.accepted.tolist() == [0]
    assert verdict.tokens[0, :1].tolist() == [1]


def test_no_drafts_is_one_plain_greedy_step():
    drafts = torch.empty((2, 0), dtype=torch.long)
    verdict = verify_greedy(drafts, logits_for([[3], [6]]))
    assert verdict.accepted.tolist() == [0, 0]
    assert verdict.tokens.tolist() == [[3], [6]]
