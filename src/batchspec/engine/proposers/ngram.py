"""Prompt lookup as a proposer: each row's drafts are its lookup chain (:mod:`batchspec.engine.lookup`), with no
draft model; sampling rows get a one-hot ``q`` at every lookup draft."""

from __future__ import annotations

from batchspec.config import DEFAULT_MAX_NGRAM, DEFAULT_MIN_NGRAM
from batchspec.engine.draft_length import Reach
from batchspec.engine.lookup import NgramIndex
from batchspec.engine.proposers import Proposal, ProposalHost, ProposalPlan
from batchspec.engine.runner import ModelRunner
from batchspec.engine.sampling import RoundSampling
from batchspec.engine.state import BatchState, Sequence


class NgramProposer:
    """Prompt-lookup drafts for every row; rows whose text has no match propose nothing this round (a plain
    step of the target inside the same forward). Sampling rows get a one-hot ``q`` at each lookup draft, and a
    draft for their bonus position when the lookup after their last draft finds one."""

    uses_draft_model = False
    model_prior = None

    def __init__(self, n_min: int = DEFAULT_MIN_NGRAM, n_max: int = DEFAULT_MAX_NGRAM) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max; got n_min={n_min}, n_max={n_max}")
        self.n_min, self.n_max = n_min, n_max

    def index(self, row: Sequence) -> NgramIndex:
        """The row's index, brought up to date with its text: only the tokens it gained are read (a row's text, its
        prompt then its output, only grows)."""
        if row.lookup is None:
            row.lookup = NgramIndex(self.n_min, self.n_max)
        indexed = len(row.lookup.tokens)
        if indexed < len(row.prompt) + len(row.output):
            row.lookup.extend(row.prompt[indexed:] + row.output[max(indexed - len(row.prompt), 0) :])
        return row.lookup

    def chains(self, rows: list[Sequence], limit: int) -> list[list[int]]:
        """Each row's lookup chain of at most ``limit`` drafts."""
        return [self.index(row).chain(limit) for row in rows]

    def reach(self, rows: list[Sequence], limit: int) -> Reach:
        chains = self.chains(rows, limit)
        return Reach(
            lookups=[len(c) for c in chains], uses_draft_model=False, first=[c[0] if c else None for c in chains]
        )

    def plan(self, rows: list[Sequence], lengths: list[int]) -> ProposalPlan:
        return lookup_plan(self.chains(rows, max(lengths, default=0) + 1), lengths)

    def propose(
        self, batch: BatchState, plan: ProposalPlan, sampling: RoundSampling | None, runner: ModelRunner
    ) -> Proposal:
        tokens, lengths, bonus = plan.staged  # [B, k+1], [B], [B]
        return Proposal(tokens, lengths, plan.host, bonus_drafted=None if sampling is None else bonus.bool())

    def cached_after(self, batch: BatchState, proposal: Proposal, accepted: list[int]) -> list[int]:
        return batch.host.draft_cached


def lookup_plan(chains: list[list[int]], lengths: list[int]) -> ProposalPlan:
    """Each row's chain, cut at its length; the next chain entry is its bonus-position draft (used by a sampling
    row). Columns: the drafts ``[B, k+1]``, the lengths ``[B]`` and whether a bonus draft exists ``[B]``.

    Example: chains ``[[5, 6, 7], []]``, lengths ``[2, 2]`` → lengths ``[2, 0]``, drafts ``[[5, 6, 7], [0, 0, 0]]``,
    bonus drafts ``[1, 0]`` (row 0's is 7).
    """
    lengths = [min(n, len(chain)) for n, chain in zip(lengths, chains, strict=True)]
    k = max(lengths, default=0)
    drafted = [chain[: k + 1] for chain in chains]
    matrix = [chain + [0] * (k + 1 - len(chain)) for chain in drafted]  # [B, k+1]
    bonus = [int(len(chain) > n) for chain, n in zip(chains, lengths, strict=True)]
    return ProposalPlan(ProposalHost(lengths=lengths), columns=(matrix, lengths, bonus))
