"""The round loop: realign → propose → verify → accept. Schedulers choose the rows of every round."""

from __future__ import annotations

import torch

from batchspec.config import SpecConfig
from batchspec.kv_cache import Slab
from batchspec.metrics import GenerationStats, StageTimer
from batchspec.models.runner import forward_columns
from batchspec.proposers import DraftModelProposer, NoDraftProposer, Proposal, Proposer
from batchspec.realign import assemble, plan_layout
from batchspec.state import BatchState, KVLocation, Sequence
from batchspec.verifier import Verdict, verify_greedy


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
        with self.timer.stage("draft"):
            proposal = self.proposer.propose(batch, k)
        with self.timer.stage("verify"):
            verdict = self.verify(batch, proposal)
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

    def verify(self, batch: BatchState, proposal: Proposal) -> Verdict:
        """Target forward over the uncached columns (the pending token, or the whole prompt in a row's first
        round) followed by the drafts; greedy acceptance."""
        cache = batch.slab.target
        inputs = torch.cat([batch.tokens[:, cache.length :], proposal.tokens], dim=1)  # [B, q + k]
        target_logits = forward_columns(self.target, batch, cache, inputs, logits_to_keep=proposal.k + 1)
        return verify_greedy(proposal.tokens, target_logits)  # target_logits: [B, k+1, V]

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
