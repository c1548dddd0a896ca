"""Proposers: who drafts the k tokens the target verifies.

A proposer has two methods, like transformers' ``CandidateGenerator``: ``propose`` drafts for the current
batch, and ``realign`` moves its own state after the engine has accepted tokens and repadded the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from batchspec.models.runner import ModelRunner
from batchspec.realign import RealignPlan
from batchspec.state import BatchState


@dataclass(frozen=True)
class Proposal:
    """Draft tokens for one round.

    Attributes:
        tokens: ``[B, k]`` drafted token ids ``d_1 .. d_k``.
        draft_valid: ``[B]`` draft-cache columns that stay valid for each row if it accepts ``a`` drafts,
            given as the count for ``a = 0``; the engine adds ``min(a, k - 1)``.
    """

    tokens: torch.Tensor  # [B, k]
    draft_valid: torch.Tensor  # [B]

    @property
    def k(self) -> int:
        return self.tokens.shape[1]

    def valid_after(self, accepted: torch.Tensor) -> torch.Tensor:
        """``[B]`` draft-cache columns valid for each row once ``accepted[i]`` drafts are kept."""
        if self.k == 0:
            return self.draft_valid
        return self.draft_valid + accepted.clamp(max=self.k - 1)


class Proposer(Protocol):
    def propose(self, batch: BatchState, k: int) -> Proposal: ...

    @property
    def cache_len(self) -> int | None:
        """Columns in the proposer's own KV cache (None when it keeps none)."""
        ...

    def realign(self, plan: RealignPlan) -> int:
        """Apply the engine's realignment to the proposer's own state; return its cached column count."""
        ...


class NoDraftProposer:
    """Proposes nothing: every round is one plain greedy step of the target (the autoregressive method)."""

    def propose(self, batch: BatchState, k: int) -> Proposal:
        empty = batch.tokens.new_empty((batch.size, 0))
        return Proposal(tokens=empty, draft_valid=batch.pad.new_zeros(batch.size))

    @property
    def cache_len(self) -> int | None:
        return None

    def realign(self, plan: RealignPlan) -> int:
        return 0


class DraftModelProposer:
    """Greedy drafting with a small causal LM that keeps its own KV cache across rounds.

    The draft first re-reads the columns its cache lacks (``batch.draft_len .. L-1``, at least the pending
    token), then feeds back each drafted token: ``k`` forwards for ``k`` tokens. Its cache then holds the
    pending token and ``d_1 .. d_{k-1}``; ``d_k`` is only ever needed when all ``k`` are accepted, and is
    re-read in the next round.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.runner = ModelRunner(model)

    def propose(self, batch: BatchState, k: int) -> Proposal:
        draft_valid = torch.full_like(batch.pad, batch.width if k else batch.draft_len)
        tokens = batch.tokens.new_empty((batch.size, k))  # [B, k]
        inputs = batch.tokens[:, batch.draft_len :]  # [B, L - draft_len]
        for j in range(k):
            logits = self.runner.forward(batch, inputs, logits_to_keep=1)  # [B, 1, V]
            tokens[:, j] = logits[:, -1].argmax(dim=-1)
            inputs = tokens[:, j : j + 1]
        return Proposal(tokens=tokens, draft_valid=draft_valid)

    @property
    def cache_len(self) -> int:
        return self.runner.cache.length

    def realign(self, plan: RealignPlan) -> int:
        self.runner.cache.realign(plan, plan.draft_len)
        return plan.draft_len
