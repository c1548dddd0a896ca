"""The round loop: realign → propose → verify → accept. Schedulers choose the rows of every round.

Rows with temperature 0 take the greedy path (argmax drafts, :func:`~batchspec.verifier.verify_greedy`); rows
with temperature > 0 sample losslessly (sampled drafts with their ``q``, the target's warped ``p``,
:func:`~batchspec.verifier.verify_sampling`), with random numbers keyed by each row's seed and output position.
"""

from __future__ import annotations

import torch

from batchspec.config import SpecConfig
from batchspec.kv_cache import Slab
from batchspec.metrics import GenerationStats, StageTimer
from batchspec.models.runner import forward_columns
from batchspec.proposers import DraftModelProposer, NoDraftProposer, Proposal, Proposer
from batchspec.realign import assemble, plan_layout
from batchspec.sampling import RoundSampling, RowRandom, warp
from batchspec.state import BatchState, KVLocation, Sequence
from batchspec.verifier import Verdict, sample_target, verify_greedy, verify_sampling


class Engine:
    """Runs rounds of the target and (for speculative methods) the draft over rows a scheduler picks."""

    def __init__(
        self,
        target: torch.nn.Module,
        draft: torch.nn.Module | None,
        config: SpecConfig,
        stats: GenerationStats,
        timer: StageTimer,
    ) -> None:
        self.target = target
        self.config = config
        self.stats = stats
        self.timer = timer
        self.eos = frozenset(config.eos_token_ids)
        self.device = next(target.parameters()).device
        self.proposer: Proposer = DraftModelProposer(draft) if config.speculative and draft else NoDraftProposer()
        draft_layers = _num_layers(draft) if isinstance(self.proposer, DraftModelProposer) else None
        self.layers = (_num_layers(target), draft_layers)

    def step(self, rows: list[Sequence]) -> None:
        """One round over ``rows`` (unfinished, at most ``batch_size``); finished rows release their KV."""
        with self.timer.stage("realign"):
            batch = self.realign(rows)
        k = self.draft_length(rows)
        sampling = self.round_sampling(rows)
        with self.timer.stage("draft"):
            proposal = self.proposer.propose(batch, k, sampling)
        with self.timer.stage("verify"):
            verdict = self.verify(batch, proposal, sampling)
        with self.timer.stage("other"):
            self.accept(batch, proposal, verdict)
        if self.config.check_invariants:
            for row in rows:
                if not row.finished:
                    row.check_location()

    def realign(self, rows: list[Sequence]) -> BatchState:
        """Lay the rows out for this round, reusing their slab when they are in lockstep (see ``realign.py``)."""
        layout = plan_layout(rows, self.device)
        with self.timer.gathering(active=layout.reuse is None):
            batch = assemble(layout, rows, filler=self.config.pad_token_id, layers=self.layers)
        self.stats.record_layout(size=len(rows), padded=layout.padded, copied=layout.reuse is None)
        if self.config.check_invariants:
            batch.check()
        return batch

    def draft_length(self, rows: list[Sequence]) -> int:
        """``k`` for this round, clipped so that no row drafts past its remaining budget."""
        if not self.config.speculative:
            return 0
        return min(self.config.num_draft_tokens, min(row.remaining for row in rows) - 1)

    def round_sampling(self, rows: list[Sequence]) -> RoundSampling | None:
        """The rows' shared sampling settings with their seeds and output offsets; None for a greedy round."""
        params = rows[0].sampling
        assert all(row.sampling == params for row in rows), "rows of one round share their sampling params"
        if params.greedy:
            return None
        seeds = torch.tensor([row.seed for row in rows], dtype=torch.long, device=self.device)  # [B]
        offsets = torch.tensor([len(row.output) for row in rows], dtype=torch.long, device=self.device)  # [B]
        return RoundSampling(params=params, rand=RowRandom(seeds=seeds, offsets=offsets))

    def verify(self, batch: BatchState, proposal: Proposal, sampling: RoundSampling | None) -> Verdict:
        """Target forward over the uncached columns (the pending token, or the whole prompt in a row's first
        round) followed by the drafts ``d_1 .. d_k``; greedy acceptance, or speculative sampling against the
        warped target distribution ``p``."""
        cache = batch.slab.target
        inputs = torch.cat([batch.tokens[:, cache.length :], proposal.tokens], dim=1)  # [B, q + k]
        target_logits = forward_columns(self.target, batch, cache, inputs, logits_to_keep=proposal.k + 1)
        if sampling is None:
            return verify_greedy(proposal.tokens, target_logits)  # target_logits: [B, k+1, V]
        p = warp(target_logits, sampling.params)  # [B, k+1, V] float64
        if not proposal.sampled:
            return sample_target(p, sampling.rand)
        return verify_sampling(proposal.drafts, proposal.q, p, sampling.rand)

    def accept(self, batch: BatchState, proposal: Proposal, verdict: Verdict) -> None:
        """Append each row's gained tokens (cut at EOS or budget) and record where its KV now lives."""
        slab = Slab(torch.cat([batch.tokens, verdict.tokens], dim=1), batch.slab.target, batch.slab.draft)
        draft_cached = self.proposer.cached_after(batch, proposal, verdict.accepted).tolist()
        rows = zip(batch.rows, verdict.gained.tolist(), verdict.tokens.tolist(), batch.pad.tolist(), strict=True)
        for i, (row, gained, tokens, pad) in enumerate(rows):
            self.stats.generated_tokens += row.append(tokens[:gained], self.eos)
            if not row.finished:
                row.kv = KVLocation(slab, i, start=pad, target_cached=row.content_len - 1, draft_cached=draft_cached[i])
        self.stats.record_round(verdict.accepted.tolist(), proposal.k)


def _num_layers(model: torch.nn.Module) -> int:
    return model.config.get_text_config().num_hidden_layers
