"""Proposers: who drafts the k tokens the target verifies.

Like transformers' ``CandidateGenerator``, a proposer has two methods: ``propose`` drafts for the current batch,
and ``cached_after`` says how much of its own KV cache stays valid once the engine has accepted tokens, so that
the next round's layout knows which columns the draft must re-read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from batchspec.models.runner import forward_columns
from batchspec.state import BatchState


@dataclass(frozen=True)
class Proposal:
    """Draft tokens for one round: ``tokens`` ``[B, k]`` are ``d_1 .. d_k``."""

    tokens: torch.Tensor  # [B, k]

    @property
    def k(self) -> int:
        return self.tokens.shape[1]


class Proposer(Protocol):
    def propose(self, batch: BatchState, k: int) -> Proposal: ...

    def cached_after(self, batch: BatchState, proposal: Proposal, accepted: torch.Tensor) -> torch.Tensor:
        """``[B]`` draft-cache columns valid from each row's first real token once ``accepted[i]`` drafts
        of ``proposal`` are kept."""
        ...


class NoDraftProposer:
    """Proposes nothing: every round is one plain greedy step of the target (the autoregressive method)."""

    def propose(self, batch: BatchState, k: int) -> Proposal:
        return Proposal(tokens=batch.tokens.new_empty((batch.size, 0)))

    def cached_after(self, batch: BatchState, proposal: Proposal, accepted: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(accepted)


class DraftModelProposer:
    """Greedy drafting with a small causal LM whose KV cache (``batch.slab.draft``) lives across rounds.

    The draft first re-reads the columns its cache lacks (``draft_len .. L-1``, at least the pending token),
    then feeds back each drafted token: ``k`` forwards for ``k`` tokens. Its cache then holds every real
    column, the pending token and ``d_1 .. d_{k-1}``; ``d_k`` matters only when all ``k`` are accepted, and is
    re-read in the next round.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def propose(self, batch: BatchState, k: int) -> Proposal:
        cache = batch.slab.draft
        assert cache is not None, "a draft-model batch carries a draft cache"
        tokens = batch.tokens.new_empty((batch.size, k))  # [B, k]
        inputs = batch.tokens[:, cache.length :]  # [B, L - draft_len]
        for j in range(k):
            logits = forward_columns(self.model, batch, cache, inputs, logits_to_keep=1)  # [B, 1, V]
            tokens[:, j] = logits[:, -1].argmax(dim=-1)
            inputs = tokens[:, j : j + 1]
        return Proposal(tokens=tokens)

    def cached_after(self, batch: BatchState, proposal: Proposal, accepted: torch.Tensor) -> torch.Tensor:
        if proposal.k == 0:
            return (batch.draft_len - batch.pad).clamp(min=0)
        return batch.content + accepted.clamp(max=proposal.k - 1)
