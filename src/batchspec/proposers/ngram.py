"""Prompt lookup as a proposer: each row's drafts are its lookup chain (:mod:`batchspec.proposers.lookup`), with no
draft model; sampling rows get a one-hot ``q`` at every lookup draft."""

from __future__ import annotations

import torch

from batchspec.controller import Reach
from batchspec.proposers import Proposal
from batchspec.proposers.lookup import DEFAULT_MAX_NGRAM, DEFAULT_MIN_NGRAM, NgramIndex
from batchspec.sampling import RoundSampling
from batchspec.state import BatchState, Sequence


class NgramProposer:
    """Prompt-lookup drafts for every row; rows whose text has no match propose nothing this round (a plain
    step of the target inside the same forward). Sampling rows get a one-hot ``q`` at each lookup draft, and a
    draft for their bonus position when the lookup after their last draft finds one."""

    uses_draft_model = False

    def __init__(self, n_min: int = DEFAULT_MIN_NGRAM, n_max: int = DEFAULT_MAX_NGRAM) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max; got n_min={n_min}, n_max={n_max}")
        self.n_min, self.n_max = n_min, n_max

    def index(self, row: Sequence) -> NgramIndex:
        """The row's index, brought up to date with its text."""
        if row.lookup is None:
            row.lookup = NgramIndex(self.n_min, self.n_max)
        row.lookup.extend(row.prompt + row.output)
        return row.lookup

    def chains(self, rows: list[Sequence], limit: int) -> list[list[int]]:
        """Each row's lookup chain of at most ``limit`` drafts."""
        return [self.index(row).chain(limit) for row in rows]

    def reach(self, rows: list[Sequence], limit: int) -> Reach:
        chains = self.chains(rows, limit)
        return Reach(lookups=[len(c) for c in chains], model=False, first=[c[0] if c else None for c in chains])

    def propose(self, batch: BatchState, lengths: torch.Tensor, sampling: RoundSampling | None) -> Proposal:
        chains = self.chains(batch.rows, int(lengths.max()) + 1 if lengths.numel() else 1)
        return lookup_proposal(batch, chains, lengths, sampling)

    def cached_after(self, batch: BatchState, proposal: Proposal, accepted: torch.Tensor) -> torch.Tensor:
        return batch.draft_cached


def lookup_proposal(
    batch: BatchState, chains: list[list[int]], lengths: torch.Tensor, sampling: RoundSampling | None
) -> Proposal:
    """A proposal of each row's chain, cut at its length; the next chain entry is its bonus-position draft."""
    found = torch.tensor([len(c) for c in chains], dtype=torch.long, device=lengths.device)  # [B]
    lengths = torch.minimum(lengths, found)
    k = int(lengths.max()) if lengths.numel() else 0
    tokens = batch.tokens.new_zeros((batch.size, k + 1))  # [B, k+1]
    looked = torch.zeros_like(tokens, dtype=torch.bool)  # [B, k+1]
    for i, chain in enumerate(chains):
        drafted = chain[: k + 1]
        tokens[i, : len(drafted)] = torch.tensor(drafted, dtype=torch.long)
        looked[i, : len(drafted)] = True
    bonus = None if sampling is None else found > lengths
    return Proposal(tokens, lengths, bonus_drafted=bonus, looked=looked)
