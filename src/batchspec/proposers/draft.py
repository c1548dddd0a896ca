"""Drafting with a small causal LM whose KV cache (``batch.slab.draft``) lives across rounds, optionally with
prompt lookup first (the hybrid proposer)."""

from __future__ import annotations

from dataclasses import replace

import torch

from batchspec.controller import Reach
from batchspec.proposers import Proposal, ProposalHost, ProposalPlan, point_masses
from batchspec.proposers.ngram import NgramProposer
from batchspec.runner import ModelRunner
from batchspec.sampling import RoundSampling, Stream, sample_draft, warp_rows
from batchspec.state import BatchState, Sequence


class DraftModelProposer:
    """Drafts ``d_1 .. d_k`` (``k`` = the longest row's length) for every row of the batch at once.

    The draft first re-reads the columns its cache lacks (``draft_len .. L-1``, at least the pending token),
    then feeds back each drafted token: ``k`` forwards for ``k`` tokens. The cache then holds every real column,
    the pending token and ``d_1 .. d_{k-1}``; ``d_k`` matters only when all ``k`` are accepted, and is re-read in
    the next round. When a row samples, one more forward drafts the bonus position of the longest rows (shorter
    rows draw theirs at the step after their last draft). A round in which no row drafts leaves the draft idle
    and its cache as it was: it catches up when it next runs.

    With ``lookup`` (the hybrid proposer) every position is first looked up in the row's own text
    (:mod:`batchspec.lookup`) and the draft model fills only the positions where the lookup finds nothing; a step
    at which every row that needs a draft has a lookup draft runs no draft forward (its tokens are fed at the next
    forward), so the draft's cache stays right for every row. Lookup drafts of sampling rows have a one-hot ``q``.
    Which step runs a forward is decided on the host; the only device reads are the drafted tokens the lookups go
    on from (see :class:`_RoundLookups`), none without lookup.
    """

    uses_draft_model = True

    def __init__(self, model: torch.nn.Module, lookup: NgramProposer | None = None) -> None:
        self.model = model
        self.lookup = lookup

    def reach(self, rows: list[Sequence], limit: int) -> Reach:
        lag = [row.content_len - 1 - (row.kv.draft_cached if row.kv else 0) for row in rows]
        if self.lookup is None:
            return Reach(lookups=[0] * len(rows), uses_draft_model=True, lag=lag)
        return replace(self.lookup.reach(rows, limit), uses_draft_model=True, lag=lag)

    def plan(self, rows: list[Sequence], lengths: list[int]) -> ProposalPlan:
        lookups = _RoundLookups(self.lookup, rows, max(lengths, default=0))
        host = ProposalHost(lengths=lengths, looked_up=None if self.lookup is None else lookups.looked_up)
        return ProposalPlan(host, columns=(lengths,), lookups=lookups)

    def propose(
        self, batch: BatchState, plan: ProposalPlan, sampling: RoundSampling | None, runner: ModelRunner
    ) -> Proposal:
        (staged_lengths,) = plan.staged  # [B]
        lengths, lookups, host = plan.host.lengths, plan.lookups, plan.host
        k = max(lengths, default=0)
        sampled = sampling is not None and sampling.any_sampled
        steps = k + int(sampled)
        tokens = batch.tokens.new_zeros((batch.size, k + 1))  # [B, k+1]: drafts, lookups written as found
        looked_up = torch.zeros_like(tokens, dtype=torch.bool)  # [B, k+1]
        if steps == 0:
            return Proposal(tokens, staged_lengths, host)
        needed = _needed(lengths, sampling.rows if sampled else (), steps)
        q, runs = None, []
        inputs = batch.tokens[:, batch.slab.draft.length :]  # [B, L - draft_len]: columns the draft lacks
        for j in range(steps):
            _write_column(tokens, looked_up, j, lookups.at(j), runner)
            if all(lookups.looked_up[i][j] or not needed[i][j] for i in range(batch.size)):
                inputs = torch.cat([inputs, tokens[:, j : j + 1]], dim=1)
                lookups.push(j, tokens, needed)
                continue
            if not runs:
                _check_caught_up(batch)
            drafted, q = self._model_step(batch, inputs, runner, tokens.shape, q, j, sampling if sampled else None)
            tokens[:, j] = torch.where(looked_up[:, j], tokens[:, j], drafted)  # lookup drafts go first
            inputs = tokens[:, j : j + 1]
            runs.append(j)
            lookups.push(j, tokens, needed)
        kept = dict(draft_fed=max(runs, default=None), draft_forwards=len(runs))
        if not sampled:
            return Proposal(tokens, staged_lengths, host, **kept)
        if q is not None:
            _point_masses_at_lookups(q, tokens, lookups.looked_up, sampling.rows, runner)
        return Proposal(tokens, staged_lengths, host, q=q, bonus_drafted=sampling.sampled, **kept)

    def _model_step(
        self,
        batch: BatchState,
        inputs: torch.Tensor,
        runner: ModelRunner,
        shape: torch.Size,
        q: torch.Tensor | None,
        j: int,
        sampling: RoundSampling | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One draft forward over ``inputs``: ``[B]`` its argmax, or for sampling rows a draw from their ``q_j``,
        and ``q`` ``[B, k+1, V]`` with ``q_j`` filled in (None when no row samples)."""
        logits = runner.logits(self.model, batch, batch.slab.draft, inputs, keep=1)[:, -1]  # [B, V]
        drafted = logits.argmax(dim=-1)  # [B]
        if sampling is not None:
            rows = sampling.index  # [s]
            q_j = warp_rows(logits[rows], sampling.params.select(rows)).to(_q_dtype(logits.dtype))  # [s, V]
            if q is None:
                q = q_j.new_zeros((*shape, q_j.shape[-1]))  # [B, k+1, V]
            q[rows, j] = q_j
            drafted[rows] = sample_draft(q_j, sampling.rand.select(rows).uniforms(Stream.DRAFT, j + 1)[:, j])
        return drafted, q

    def cached_after(self, batch: BatchState, proposal: Proposal, accepted: list[int]) -> list[int]:
        if proposal.draft_fed is None:
            return batch.host.draft_cached
        return [c + min(a, proposal.draft_fed) for c, a in zip(batch.host.content, accepted, strict=True)]


def _check_caught_up(batch: BatchState) -> None:
    """The draft's first forward of a round feeds the columns after ``draft_len`` for every row: a row whose draft
    holds fewer (it lags) would attend to columns it never read."""
    columns = zip(batch.host.pad, batch.host.draft_cached, strict=True)
    lagging = [i for i, (pad, held) in enumerate(columns) if pad + held < batch.draft_len]
    assert not lagging, f"rows {lagging} lag behind the draft's {batch.draft_len} columns; catch them up first"


def _needed(lengths: list[int], sampling: tuple[int, ...], steps: int) -> list[list[bool]]:
    """Per row, the positions whose draft it uses: its first ``lengths[i]``, and for a sampling row the bonus
    position after them. Where every row's needed draft was looked up, the draft model skips that step.

    Example: lengths ``[2, 0]``, row 1 samples, 3 steps → ``[[T, T, F], [T, F, F]]``.
    """
    sampled = set(sampling)
    return [[j < n or (i in sampled and j == n) for j in range(steps)] for i, n in enumerate(lengths)]


class _RoundLookups:
    """Which positions of one round are looked up (with lookup, the hybrid proposer), and their drafts.

    Each row's lookup at a position depends only on its text before that position (see :mod:`batchspec.lookup`):
    after the draft model drafts for a row, its lookup goes on from the drafted token. That keeps a sampling row's
    tokens independent of the batch and of ``k`` (its ``q`` at a position is one-hot exactly where a lookup finds
    a draft), and lets a greedy row take up a copied span again after a drafted token, so that later steps may
    need no draft forward. It needs the drafted tokens on the host: each draft-model step that a later position
    needs reads ``[B]`` tokens back (the only reads of a round besides the verdict).
    """

    def __init__(self, lookup: NgramProposer | None, rows: list[Sequence], k: int) -> None:
        self.cursors = {i: lookup.index(row).cursor() for i, row in enumerate(rows)} if lookup else {}
        self.values = [[0] * (k + 1) for _ in rows]  # [B, k+1] lookup drafts (0: none)
        self.looked_up = [[False] * (k + 1) for _ in rows]  # [B, k+1]

    def at(self, j: int) -> list[tuple[int, int]]:
        """Look up position ``j`` of every row; returns the ``(row, draft)`` found."""
        found = []
        for i, cursor in self.cursors.items():
            token = cursor.next()
            if token is not None:
                self.values[i][j], self.looked_up[i][j] = token, True
                found.append((i, token))
        return found

    def push(self, j: int, tokens: torch.Tensor, needed: list[list[bool]]) -> None:
        """Step ``j``'s drafts are chosen (``tokens`` ``[B, k+1]``): the lookups go on from them. The drafted tokens
        are read only for rows that need a later position (a row's later lookups matter only there)."""
        drafted = [i for i in self.cursors if not self.looked_up[i][j] and any(needed[i][j + 1 :])]
        if drafted:
            values = tokens[drafted, j].tolist()  # a read: the drafted tokens the lookups continue from
            for i, token in zip(drafted, values, strict=True):
                self.values[i][j] = token
        for i, cursor in self.cursors.items():
            cursor.push(self.values[i][j])


def _write_column(
    tokens: torch.Tensor, looked_up: torch.Tensor, j: int, found: list[tuple[int, int]], runner: ModelRunner
) -> None:
    """Put the lookup drafts ``found`` (``(row, draft)``) of step ``j`` into ``tokens`` and ``looked_up``
    (``[B, k+1]`` each)."""
    if not found:
        return
    rows, drafts = runner.stage([i for i, _ in found], [t for _, t in found])  # [n], [n]
    tokens[rows, j] = drafts
    looked_up[rows, j] = True


def _point_masses_at_lookups(
    q: torch.Tensor, tokens: torch.Tensor, looked_up: list[list[bool]], rows: tuple[int, ...], runner: ModelRunner
) -> None:
    """Give the lookup drafts of sampling rows a one-hot ``q`` (``q`` ``[B, k+1, V]``, in place)."""
    places = [(i, j) for i in rows for j, found in enumerate(looked_up[i]) if found]
    if not places:
        return
    at_rows, at_columns = runner.stage([i for i, _ in places], [j for _, j in places])  # [n], [n]
    drafts = tokens[at_rows, at_columns]  # [n]
    q[at_rows, at_columns] = point_masses(drafts[:, None], q.shape[-1]).squeeze(1).to(q.dtype)


def _q_dtype(logits_dtype: torch.dtype) -> torch.dtype:
    """float32 for half, bfloat16 and float32 drafts, float64 for float64 ones: q is ``[B, k+1, V]`` for a whole
    round, so it is not kept in float64 unless the draft computes in float64."""
    return torch.promote_types(logits_dtype, torch.float32)
