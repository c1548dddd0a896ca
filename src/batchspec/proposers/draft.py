"""Drafting with a small causal LM whose KV cache (``batch.slab.draft``) lives across rounds, optionally with
prompt lookup first (the hybrid proposer)."""

from __future__ import annotations

from dataclasses import replace

import torch

from batchspec.controller import Reach
from batchspec.forward import forward_columns
from batchspec.proposers import Proposal, point_masses
from batchspec.proposers.lookup import LookupCursor
from batchspec.proposers.ngram import NgramProposer
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
    (:mod:`batchspec.proposers.lookup`) and the draft model fills only the positions where the lookup finds
    nothing; a step at which every row has a lookup draft runs no draft forward (its tokens are fed at the next
    forward), so the draft's cache stays right for every row. Lookup drafts of sampling rows have a one-hot ``q``.
    """

    uses_draft_model = True

    def __init__(self, model: torch.nn.Module, lookup: NgramProposer | None = None) -> None:
        self.model = model
        self.lookup = lookup

    def reach(self, rows: list[Sequence], limit: int) -> Reach:
        lag = [row.content_len - 1 - (row.kv.draft_cached if row.kv else 0) for row in rows]
        if self.lookup is None:
            return Reach(lookups=[0] * len(rows), model=True, lag=lag)
        return replace(self.lookup.reach(rows, limit), model=True, lag=lag)

    def propose(self, batch: BatchState, lengths: torch.Tensor, sampling: RoundSampling | None) -> Proposal:
        k = int(lengths.max()) if lengths.numel() else 0
        sampled = sampling is not None and sampling.any_sampled
        steps = k + int(sampled)
        tokens = batch.tokens.new_zeros((batch.size, k + 1))  # [B, k+1]
        if steps == 0:
            return Proposal(tokens=tokens, lengths=lengths)
        cursors = None if self.lookup is None else [self.lookup.index(row).cursor() for row in batch.rows]
        looked = torch.zeros_like(tokens, dtype=torch.bool)  # [B, k+1]: drafts found by lookup
        needed = _needed(lengths, sampling if sampled else None, steps)  # [B, steps]
        q, fed, forwards = None, None, 0
        inputs = batch.tokens[:, batch.slab.draft.length :]  # [B, L - draft_len]: columns the draft lacks
        for j in range(steps):
            found = self._look_up(cursors, tokens, looked, j) or bool((looked[:, j] | ~needed[:, j]).all())
            if not found:
                if forwards == 0:
                    _check_caught_up(batch)
                model, q = self._model_step(batch, inputs, tokens.shape, q, j, sampling if sampled else None)
                tokens[:, j] = torch.where(looked[:, j], tokens[:, j], model)  # lookup drafts go first
                inputs, fed, forwards = tokens[:, j : j + 1], j, forwards + 1
            else:
                inputs = torch.cat([inputs, tokens[:, j : j + 1]], dim=1)
            if cursors is not None:
                for cursor, token in zip(cursors, tokens[:, j].tolist(), strict=True):
                    cursor.push(token)
        kept = dict(draft_fed=fed, draft_forwards=forwards, looked=looked if cursors is not None else None)
        if not sampled:
            return Proposal(tokens=tokens, lengths=lengths, **kept)
        if q is not None:
            q[looked] = point_masses(tokens[looked][:, None], q.shape[-1]).squeeze(1).to(q.dtype)
        return Proposal(tokens, lengths, q=q, bonus_drafted=sampling.sampled, **kept)

    @staticmethod
    def _look_up(cursors: list[LookupCursor] | None, tokens: torch.Tensor, looked: torch.Tensor, j: int) -> bool:
        """Write the lookup drafts for step ``j`` into ``tokens``; True when every row has one."""
        if cursors is None:
            return False
        for i, cursor in enumerate(cursors):
            token = cursor.next()
            if token is not None:
                tokens[i, j], looked[i, j] = token, True
        return bool(looked[:, j].all())

    def _model_step(
        self,
        batch: BatchState,
        inputs: torch.Tensor,
        shape: torch.Size,
        q: torch.Tensor | None,
        j: int,
        sampling: RoundSampling | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One draft forward over ``inputs``: ``[B]`` its argmax, or for sampling rows a draw from their ``q_j``,
        and ``q`` ``[B, k+1, V]`` with ``q_j`` filled in (None when no row samples)."""
        logits = forward_columns(self.model, batch, batch.slab.draft, inputs, logits_to_keep=1)[:, -1]  # [B, V]
        model = logits.argmax(dim=-1)  # [B]
        if sampling is not None:
            rows = sampling.sampled.nonzero().squeeze(1)  # [s]
            q_j = warp_rows(logits[rows], sampling.params.select(rows)).to(_q_dtype(logits.dtype))  # [s, V]
            if q is None:
                q = q_j.new_zeros((*shape, q_j.shape[-1]))  # [B, k+1, V]
            q[rows, j] = q_j
            model[rows] = sample_draft(q_j, sampling.rand.uniforms(Stream.DRAFT, j + 1)[rows, j])
        return model, q

    def cached_after(self, batch: BatchState, proposal: Proposal, accepted: torch.Tensor) -> torch.Tensor:
        if proposal.draft_fed is None:
            return batch.draft_cached
        return batch.content + accepted.clamp(max=proposal.draft_fed)


def _check_caught_up(batch: BatchState) -> None:
    """The draft's first forward of a round feeds the columns after ``draft_len`` for every row: a row whose draft
    holds fewer (it lags) would attend to columns it never read."""
    lagging = (batch.pad + batch.draft_cached < batch.draft_len).nonzero().squeeze(1).tolist()  # rows
    assert not lagging, f"rows {lagging} lag behind the draft's {batch.draft_len} columns; catch them up first"


def _needed(lengths: torch.Tensor, sampling: RoundSampling | None, steps: int) -> torch.Tensor:
    """``[B, steps]`` positions whose draft a row uses: its first ``lengths[i]``, and for a sampling row the bonus
    position after them. Where every row's needed draft was looked up, the draft model skips that step.

    Example: lengths ``[2, 0]``, row 1 samples, 3 steps → ``[[T, T, F], [T, F, F]]``.
    """
    columns = torch.arange(steps, device=lengths.device)[None, :]  # [1, steps]
    needed = columns < lengths[:, None]  # [B, steps]
    if sampling is not None:
        needed |= (columns == lengths[:, None]) & sampling.sampled[:, None]
    return needed


def _q_dtype(logits_dtype: torch.dtype) -> torch.dtype:
    """float32 for half, bfloat16 and float32 drafts, float64 for float64 ones: q is ``[B, k+1, V]`` for a whole
    round, so it is not kept in float64 unless the draft computes in float64."""
    return torch.promote_types(logits_dtype, torch.float32)
