"""Verification: the target scores ``[pending, d_1 .. d_k]`` in one forward and each row keeps the longest
prefix of drafts the target agrees with, plus one token from the target itself.

Terms (used throughout batchspec):
    p: the target's next-token distribution (here its logits), ``[B, k+1, V]``; position ``j`` scores the token
       after ``d_j`` (``d_0`` is the pending token).
    q: the draft's distribution at the same positions (not needed for greedy verification).
    accepted (``a``): number of leading drafts accepted, ``0 <= a <= k``.
    bonus token: the target's own token at position ``a`` — the correction when ``d_{a+1}`` was rejected,
       or the extra ``(k+1)``-th token when all ``k`` drafts were accepted.
Greedy verification accepts ``d_j`` while ``d_j == argmax p_{j-1}``; the row gains ``a + 1`` tokens, which
are exactly ``argmax p_0 .. argmax p_a``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Verdict:
    """Outcome of one verification.

    Attributes:
        accepted: ``[B]`` drafts accepted per row (``a``).
        tokens: ``[B, k+1]`` the tokens each row gains are ``tokens[i, :accepted[i] + 1]``.
    """

    accepted: torch.Tensor  # [B]
    tokens: torch.Tensor  # [B, k+1]

    @property
    def gained(self) -> torch.Tensor:  # [B]
        return self.accepted + 1


def verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> Verdict:
    """Greedy verification of ``draft_tokens`` ``[B, k]`` against ``target_logits`` ``[B, k+1, V]``."""
    target_tokens = target_logits.argmax(dim=-1)  # [B, k+1]
    k = draft_tokens.shape[1]
    matches = draft_tokens == target_tokens[:, :k]  # [B, k]
    accepted = matches.long().cumprod(dim=1).sum(dim=1)  # [B]
    return Verdict(accepted=accepted, tokens=target_tokens)
