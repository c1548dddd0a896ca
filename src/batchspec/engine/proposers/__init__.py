"""Proposers: who drafts the tokens the target verifies.

Like transformers' ``CandidateGenerator``, a proposer drafts for the current batch and says, with ``cached_after``,
how much of the draft model's KV cache stays valid once the engine has accepted tokens, so that the next round's
layout knows which columns the draft must re-read. Drafting takes two steps: ``plan`` decides on the host (how long
each row's proposal is, what prompt lookup found) and names the host columns it needs on the device, which the
engine stages with the round's other inputs in one copy; ``propose`` then drafts on the device.

A proposal carries per-row lengths: row ``i`` proposes ``d_1 .. d_{lengths[i]}`` (0 .. k) and the target accepts at
most that many. Greedy rows draft by argmax. Rows that sample also carry, at index ``lengths[i]``, a draft for the
position after their last draft (the bonus position), each ``d_j`` drawn from the warped draft distribution ``q_j``
with the row's ``Stream.DRAFT`` uniform for its output position (see :mod:`batchspec.engine.verifier`).

* :class:`NoDraftProposer` proposes nothing (the autoregressive method);
* :class:`~batchspec.engine.proposers.draft.DraftModelProposer` drafts with a small causal LM (``proposer="draft"``),
  and with prompt lookup first (``"hybrid"``);
* :class:`~batchspec.engine.proposers.ngram.NgramProposer` copies drafts from the row's own text (``"ngram"``).

A third, cheap method, ``reach``, tells how far each row could draft before the round's lengths are chosen
(:mod:`batchspec.engine.draft_length`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import torch

from batchspec.engine.draft_length import Reach
from batchspec.engine.runner import ModelRunner
from batchspec.engine.sampling import RoundSampling
from batchspec.engine.state import BatchState, Sequence


@dataclass(frozen=True)
class ProposalHost:
    """What the host knows of a proposal without reading the device.

    Attributes:
        lengths: per row, drafts proposed (0 .. k), as :attr:`Proposal.lengths`.
    """

    lengths: list[int]


@dataclass(frozen=True)
class Proposal:
    """Draft tokens for one round.

    Attributes:
        tokens: ``[B, k+1]`` ``d_1 .. d_k`` and ``d_{k+1}``; row ``i`` proposes its first ``lengths[i]``, and
            ``tokens[i, lengths[i]]`` is its draft for the bonus position where ``bonus_drafted[i]``. The target
            scores ``tokens[:, :k]``; other entries are filler.
        lengths: ``[B]`` drafts each row proposes (0 .. k).
        host: the lengths and the lookup positions as host lists.
        q: ``[B, k+1, V]`` the draft distributions the drafts of sampling rows were drawn from; None when every
            draft is a point mass (a lookup), :func:`point_masses`. float32, or float64 for a float64 draft.
        bonus_drafted: ``[B]`` rows with a draft for their bonus position (None: no row has one).
        draft_fed: drafts ``d_1 .. d_n`` whose KV the draft model's cache holds after proposing (its last forward
            read ``d_n``); None when the draft model did not run this round.
        draft_forwards: forwards the draft model ran this round.
        draft_width: columns per row its first forward read: the pending token, and where its cache lagged (it was
            idle), the columns it caught up on (0 when it did not run).
    """

    tokens: torch.Tensor  # [B, k+1]
    lengths: torch.Tensor  # [B]
    host: ProposalHost
    q: torch.Tensor | None = None  # [B, k+1, V]
    bonus_drafted: torch.Tensor | None = None  # [B]
    draft_fed: int | None = None
    draft_forwards: int = 0
    draft_width: int = 0

    def __post_init__(self) -> None:
        if self.tokens.dim() != 2 or self.lengths.shape != self.tokens.shape[:1]:
            shapes = f"{list(self.tokens.shape)}, {list(self.lengths.shape)}"
            raise ValueError(f"need tokens [B, k+1] and lengths [B], got {shapes}")

    @property
    def k(self) -> int:
        """Drafts the target scores per row (the longest row's length)."""
        return self.tokens.shape[1] - 1


@dataclass(frozen=True)
class ProposalPlan:
    """What a proposer decided on the host, before the round's one host→device copy.

    Attributes:
        host: the lengths each row proposes (and, for lookups, the positions found so far) as host lists.
        columns: host columns :meth:`Proposer.propose` needs on the device, staged with the round's other inputs.
        lookups: per row, the lookup drafts the host found (its lookup chain's length) for a draft proposer with
            lookup (the hybrid proposer; None for the others).
        staged: ``columns`` on the device, once the round's copy is made (:meth:`staged_as`).
    """

    host: ProposalHost
    columns: tuple = ()
    lookups: list[int] | None = None
    staged: tuple[torch.Tensor, ...] = ()

    def staged_as(self, tensors: tuple[torch.Tensor, ...]) -> ProposalPlan:
        """This plan with its columns on the device."""
        return replace(self, staged=tuple(tensors))


def point_masses(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[B, m, V]`` float32 ``q`` that puts all mass on ``tokens`` ``[B, m]``: the distribution of a draft that
    was looked up rather than sampled."""
    q = torch.zeros((*tokens.shape, vocab), dtype=torch.float32, device=tokens.device)
    return q.scatter_(-1, tokens[..., None], 1.0)


class Proposer(Protocol):
    uses_draft_model: bool
    model_prior: float | None  # its draft model's first draft's chance before any was tested (None: the planner's)

    def reach(self, rows: list[Sequence], limit: int) -> Reach:
        """How far each row could draft this round (up to ``limit``); cheap, used to choose the lengths."""
        ...

    def plan(self, rows: list[Sequence], lengths: list[int]) -> ProposalPlan:
        """Up to ``lengths[i]`` drafts for row ``i``: what the host decides before the round's copy."""
        ...

    def propose(
        self, batch: BatchState, plan: ProposalPlan, sampling: RoundSampling | None, runner: ModelRunner
    ) -> Proposal:
        """The drafts of ``plan`` (argmax for greedy rows, sampled with ``q`` for the others); ``plan.staged`` holds
        its columns on the device."""
        ...

    def cached_after(self, batch: BatchState, proposal: Proposal, accepted: list[int]) -> list[int]:
        """Per row, draft-cache columns valid from its first real token once ``accepted[i]`` drafts of
        ``proposal`` are kept."""
        ...


class NoDraftProposer:
    """Proposes nothing: every round is one plain step of the target (the autoregressive method)."""

    uses_draft_model = False
    model_prior = None

    def reach(self, rows: list[Sequence], limit: int) -> Reach:
        return Reach(lookups=[0] * len(rows), uses_draft_model=False)

    def plan(self, rows: list[Sequence], lengths: list[int]) -> ProposalPlan:
        return ProposalPlan(ProposalHost(lengths=[0] * len(rows)))

    def propose(
        self, batch: BatchState, plan: ProposalPlan, sampling: RoundSampling | None, runner: ModelRunner
    ) -> Proposal:
        tokens = batch.tokens.new_zeros((batch.size, 1))  # [B, 1]
        return Proposal(tokens, lengths=tokens[:, 0], host=plan.host)

    def cached_after(self, batch: BatchState, proposal: Proposal, accepted: list[int]) -> list[int]:
        return batch.host.draft_cached
