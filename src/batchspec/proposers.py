"""Proposers: who drafts the tokens the target verifies.

Like transformers' ``CandidateGenerator``, a proposer has two methods: ``propose`` drafts for the current batch,
and ``cached_after`` says how much of its own KV cache stays valid once the engine has accepted tokens, so that
the next round's layout knows which columns the draft must re-read.

Greedy rounds (``sampling=None``) draft ``d_1 .. d_k`` by argmax. Sampling rounds draft ``d_1 .. d_{k+1}``, each
``d_j`` drawn from the warped draft distribution ``q_j`` with the row's ``Stream.DRAFT`` uniform for its output
position; ``d_{k+1}`` is the draft for the bonus position (see :mod:`batchspec.verifier`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from batchspec.models.runner import forward_columns
from batchspec.sampling import RoundSampling, Stream, sample_draft, warp
from batchspec.state import BatchState


@dataclass(frozen=True)
class Proposal:
    """Draft tokens for one round.

    Attributes:
        tokens: ``[B, k]`` ``d_1 .. d_k``, the drafts the target scores.
        bonus_draft: ``[B]`` ``d_{k+1}``, the draft for the bonus position (sampling rounds with a draft only).
        q: ``[B, k+1, V]`` the draft distributions ``q_1 .. q_{k+1}`` the drafts were drawn from (with
            ``bonus_draft``); float32, or float64 for a float64 draft.
    """

    tokens: torch.Tensor  # [B, k]
    bonus_draft: torch.Tensor | None = None  # [B]
    q: torch.Tensor | None = None  # [B, k+1, V]

    def __post_init__(self) -> None:
        if (self.bonus_draft is None) != (self.q is None):
            raise ValueError("a sampled proposal carries both bonus_draft and q")

    @property
    def k(self) -> int:
        return self.tokens.shape[1]

    @property
    def sampled(self) -> bool:
        """The drafts were sampled from ``q`` (verify with :func:`batchspec.verifier.verify_sampling`)."""
        return self.q is not None

    @property
    def drafts(self) -> torch.Tensor:  # [B, k+1]
        """``d_1 .. d_{k+1}`` of a sampled proposal."""
        assert self.bonus_draft is not None, "only a sampled proposal has a draft for the bonus position"
        return torch.cat([self.tokens, self.bonus_draft[:, None]], dim=1)


class Proposer(Protocol):
    def propose(self, batch: BatchState, k: int, sampling: RoundSampling | None) -> Proposal:
        """Draft ``k`` tokens per row by argmax (``sampling`` None), or ``k + 1`` sampled ones with their ``q``."""
        ...

    def cached_after(self, batch: BatchState, proposal: Proposal, accepted: torch.Tensor) -> torch.Tensor:
        """``[B]`` draft-cache columns valid from each row's first real token once ``accepted[i]`` drafts
        of ``proposal`` are kept."""
        ...


class NoDraftProposer:
    """Proposes nothing: every round is one plain step of the target (the autoregressive method)."""

    def propose(self, batch: BatchState, k: int, sampling: RoundSampling | None) -> Proposal:
        return Proposal(tokens=batch.tokens.new_empty((batch.size, 0)))

    def cached_after(self, batch: BatchState, proposal: Proposal, accepted: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(accepted)


class DraftModelProposer:
    """Drafting with a small causal LM whose KV cache (``batch.slab.draft``) lives across rounds.

    The draft first re-reads the columns its cache lacks (``draft_len .. L-1``, at least the pending token),
    then feeds back each drafted token. Greedy: ``k`` forwards for ``k`` tokens; the cache then holds every real
    column, the pending token and ``d_1 .. d_{k-1}``; ``d_k`` matters only when all ``k`` are accepted, and is
    re-read in the next round. Sampling: ``k + 1`` forwards for ``d_1 .. d_{k+1}``, one more than greedy,
    because the bonus position needs ``q_{k+1}``; the cache then holds ``d_1 .. d_k`` as well.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def propose(self, batch: BatchState, k: int, sampling: RoundSampling | None) -> Proposal:
        if sampling is None:
            return self._propose_greedy(batch, k)
        return self._propose_sampled(batch, k, sampling)

    def cached_after(self, batch: BatchState, proposal: Proposal, accepted: torch.Tensor) -> torch.Tensor:
        if proposal.sampled:
            return batch.content + accepted.clamp(max=proposal.k)
        if proposal.k == 0:
            return (batch.draft_len - batch.pad).clamp(min=0)
        return batch.content + accepted.clamp(max=proposal.k - 1)

    def _propose_greedy(self, batch: BatchState, k: int) -> Proposal:
        cache = batch.slab.draft
        assert cache is not None, "a draft-model batch carries a draft cache"
        tokens = batch.tokens.new_empty((batch.size, k))  # [B, k]
        inputs = batch.tokens[:, cache.length :]  # [B, L - draft_len]
        for j in range(k):
            logits = forward_columns(self.model, batch, cache, inputs, logits_to_keep=1)  # [B, 1, V]
            tokens[:, j] = logits[:, -1].argmax(dim=-1)
            inputs = tokens[:, j : j + 1]
        return Proposal(tokens=tokens)

    def _propose_sampled(self, batch: BatchState, k: int, sampling: RoundSampling) -> Proposal:
        cache = batch.slab.draft
        assert cache is not None, "a draft-model batch carries a draft cache"
        drafts = batch.tokens.new_empty((batch.size, k + 1))  # [B, k+1]
        u = sampling.rand.uniforms(Stream.DRAFT, k + 1)  # [B, k+1]
        inputs = batch.tokens[:, cache.length :]  # [B, L - draft_len]
        q = None
        for j in range(k + 1):
            logits = forward_columns(self.model, batch, cache, inputs, logits_to_keep=1)[:, -1]  # [B, V]
            q_j = warp(logits, sampling.params).to(_q_dtype(logits.dtype))  # [B, V]
            if q is None:
                q = q_j.new_empty((batch.size, k + 1, q_j.shape[-1]))  # [B, k+1, V]
            q[:, j] = q_j
            drafts[:, j] = sample_draft(q_j, u[:, j])
            inputs = drafts[:, j : j + 1]
        return Proposal(tokens=drafts[:, :k], bonus_draft=drafts[:, k], q=q)


def _q_dtype(logits_dtype: torch.dtype) -> torch.dtype:
    """float32 for half, bfloat16 and float32 drafts, float64 for float64 ones: q is ``[B, k+1, V]`` for a whole
    round, so it is not kept in float64 unless the draft computes in float64."""
    return torch.promote_types(logits_dtype, torch.float32)
