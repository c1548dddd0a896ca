"""The round loop: propose → verify → accept → realign → retire, until every row of a batch is done."""

from __future__ import annotations

import torch

from batchspec.config import SpecConfig
from batchspec.metrics import GenerationStats, StageTimer
from batchspec.models.runner import ModelRunner
from batchspec.proposers import DraftModelProposer, NoDraftProposer, Proposal, Proposer
from batchspec.realign import RealignPlan, plan_realign
from batchspec.state import BatchState, Sequence
from batchspec.verifier import Verdict, verify_greedy


class Engine:
    """Decodes batches of :class:`Sequence` with the target and (for speculative methods) the draft."""

    def __init__(
        self,
        target: torch.nn.Module,
        draft: torch.nn.Module | None,
        config: SpecConfig,
        stats: GenerationStats,
        timer: StageTimer,
    ) -> None:
        self.target_model = target
        self.draft_model = draft
        self.config = config
        self.stats = stats
        self.timer = timer
        self.eos = frozenset(config.eos_token_ids)
        self.device = next(target.parameters()).device

    def decode(self, rows: list[Sequence]) -> None:
        """Run ``rows`` (at most ``batch_size`` of them) to completion; finished rows leave at once."""
        with self.timer.stage("other"):
            batch = BatchState.from_sequences(rows, pad_token_id=self.config.pad_token_id, device=self.device)
            target = ModelRunner(self.target_model)
            proposer = self.new_proposer()
        while batch.size:
            batch = self.round(batch, target, proposer)

    def new_proposer(self) -> Proposer:
        if self.config.speculative:
            assert self.draft_model is not None
            return DraftModelProposer(self.draft_model)
        return NoDraftProposer()

    def round(self, batch: BatchState, target: ModelRunner, proposer: Proposer) -> BatchState:
        """One speculative round over ``batch``; returns the realigned batch of unfinished rows."""
        k = self.draft_length(batch)
        with self.timer.stage("draft"):
            proposal = proposer.propose(batch, k)
        with self.timer.stage("verify"):
            verdict = self.verify(target, batch, proposal)
        with self.timer.stage("other"):
            keep = self.accept(batch, verdict, k)
        with self.timer.stage("realign"):
            batch = self.realign(batch, target, proposer, proposal, verdict, keep)
        if self.config.check_invariants and batch.size:
            batch.check(target_cache_len=target.cache.length, draft_cache_len=proposer.cache_len)
        return batch

    def draft_length(self, batch: BatchState) -> int:
        """``k`` for this round, clipped so that no row drafts past its remaining budget."""
        if not self.config.speculative:
            return 0
        return min(self.config.num_draft_tokens, min(row.remaining for row in batch.rows) - 1)

    @staticmethod
    def verify(target: ModelRunner, batch: BatchState, proposal: Proposal) -> Verdict:
        """Target forward over the uncached columns (the pending token, or the whole prompt in the first
        round) followed by the drafts; greedy acceptance."""
        inputs = torch.cat([batch.tokens[:, batch.target_len :], proposal.tokens], dim=1)  # [B, q + k]
        target_logits = target.forward(batch, inputs, logits_to_keep=proposal.k + 1)  # [B, k+1, V]
        return verify_greedy(proposal.tokens, target_logits)

    def accept(self, batch: BatchState, verdict: Verdict, k: int) -> torch.Tensor:
        """Append each row's gained tokens (cut at EOS or budget); returns ``[B]`` True for rows that go on."""
        gained = verdict.gained.tolist()
        tokens = verdict.tokens.tolist()
        for row, n, row_tokens in zip(batch.rows, gained, tokens, strict=True):
            self.stats.generated_tokens += row.append(row_tokens[:n], self.eos)
        self.stats.record_round(verdict.accepted.tolist(), k)
        return torch.tensor([not row.finished for row in batch.rows], device=batch.device)

    def realign(
        self,
        batch: BatchState,
        target: ModelRunner,
        proposer: Proposer,
        proposal: Proposal,
        verdict: Verdict,
        keep: torch.Tensor,
    ) -> BatchState:
        """Unpad → append → repad the kept rows, moving tokens, target KV and draft KV by the same shifts."""
        plan = plan_realign(batch.pad, batch.content, verdict.gained, keep, proposal.valid_after(verdict.accepted))
        if plan.size == 0:
            return BatchState(rows=[], tokens=batch.tokens[:0], pad=plan.pad, content=plan.content)
        target.cache.realign(plan, plan.width - 1)
        draft_len = proposer.realign(plan)
        return BatchState(
            rows=[batch.rows[i] for i in plan.rows.tolist()],
            tokens=_move_tokens(batch.tokens, verdict.tokens, plan),
            pad=plan.pad,
            content=plan.content,
            target_len=plan.width - 1,
            draft_len=draft_len,
        )


def _move_tokens(tokens: torch.Tensor, gained_tokens: torch.Tensor, plan: RealignPlan) -> torch.Tensor:
    """``[B', L']`` token matrix after the move: each kept row's old columns then its gained tokens."""
    extended = torch.cat([tokens, gained_tokens], dim=1)  # [B, L + k + 1]
    if not plan.identity:
        extended = extended.index_select(0, plan.rows)
    return extended.gather(1, plan.source_columns(plan.width))
