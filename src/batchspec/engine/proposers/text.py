"""Drafting with a model of another tokenizer than the target's (universal assisted generation): each row's text is
handed to the draft in its own tokens and its drafts back to the target as text (:mod:`batchspec.engine.retokenize`),
optionally after prompt lookup (the hybrid proposer)."""

from __future__ import annotations

from dataclasses import replace

import torch

from batchspec.engine.draft_length import Reach
from batchspec.engine.kv_cache import BatchKVCache
from batchspec.engine.proposers import Proposal, ProposalHost, ProposalPlan
from batchspec.engine.proposers.ngram import NgramProposer
from batchspec.engine.retokenize import DraftText, TextBridge, Window
from batchspec.engine.runner import ModelRunner, cache_keyword
from batchspec.engine.sampling import RoundSampling
from batchspec.engine.state import BatchState, Sequence, visible_keys
from batchspec.exact.integer.forward import integer_forward
from batchspec.families import attention_window, positions_of

# its first draft's chance before any was tested: SmolLM2-135M's first target token through the text agreed with the
# qwen2.5-coder target's 55-60% of the time (3 SpecBench answers each of coding and writing, int8)
FIRST_PRIOR = 0.55


class TextDraftProposer:
    """Drafts ``lengths[i]`` target tokens for row ``i``: its lookup chain where that is long enough (the hybrid
    proposer), else the chain and then the draft model's tokens after it, read back as text and encoded in the
    target's tokens. The draft keeps its own tokens and KV cache per row (``row.draft_text``, a
    :class:`~batchspec.engine.retokenize.DraftText`), so the engine keeps no draft columns for it
    (``uses_draft_model`` is False for the engine; its :class:`Reach` tells the planner that a draft model drafts,
    and how much of each row's text it lacks).

    Rows that sample propose their lookups only, as prompt lookup does (with the hybrid proposer; nothing without it):
    a lookup's drafts at a position are a function of the row's text before it, so a seeded row draws the same tokens
    whatever the batch and the draft length (``SpecConfig.seed``), which the draft's text, cut at another length,
    would not give; the draft's distribution is over other tokens than the target's, so its drafts could only be
    point masses anyway. The draft runs row by row: one row's forward at a time, each over its own cache (the rows'
    texts have their own lengths in the draft's tokens); its forwards are counted row by row, as the planner prices
    them (:attr:`Reach.per_row`). Each drafted token is read back to the host, where its text is made: free on the
    CPU, which it is built for; on a GPU a synchronisation a draft step and row (a batched draft over the rows' own
    caches would remove both the loop and the reads).
    """

    uses_draft_model = False
    model_prior = FIRST_PRIOR

    def __init__(self, model: torch.nn.Module, bridge: TextBridge, lookup: NgramProposer | None = None,
                 vocabulary: int = 0) -> None:
        self.model, self.bridge, self.lookup = model, bridge, lookup
        self.vocabulary = vocabulary  # the draft proposes among its first token ids only (SpecConfig.draft_vocabulary)
        self.window = attention_window(model.config)
        self.device = next(model.parameters()).device
        self.positions = positions_of(model.config.get_text_config())  # the draft's, in its own tokens

    def reach(self, rows: list[Sequence], limit: int) -> Reach:
        lag = [row.content_len - 1 - (row.draft_text.synced if row.draft_text else 0) for row in rows]
        if self.lookup is None:
            return Reach(lookups=[0] * len(rows), uses_draft_model=True, lag=lag, per_row=True)
        return replace(self.lookup.reach(rows, limit), uses_draft_model=True, lag=lag, per_row=True)

    def plan(self, rows: list[Sequence], lengths: list[int]) -> ProposalPlan:
        """Nothing to stage: the drafts are made on the host when the round proposes."""
        return ProposalPlan(ProposalHost(lengths=lengths))

    def propose(
        self, batch: BatchState, plan: ProposalPlan, sampling: RoundSampling | None, runner: ModelRunner
    ) -> Proposal:
        lengths = plan.host.lengths
        sampled = set(() if sampling is None else sampling.rows)
        k = max(lengths, default=0)
        lookups = self.lookup is not None and (k or sampled)
        chains = self.lookup.chains(batch.rows, k + 1) if lookups else [[]] * batch.size
        drafts, bonus, forwards, width = [], [], 0, 0
        for i, (row, n, chain) in enumerate(zip(batch.rows, lengths, chains, strict=True)):
            if i in sampled:  # lookups only, and the next one for the bonus position, as prompt lookup proposes
                drafts.append(chain[:n])
                bonus.append(chain[n : n + 1])
                continue
            drafted, steps, read = self._row(row, n, chain[:n])
            drafts.append(drafted)
            bonus.append([])
            forwards, width = forwards + steps, max(width, read)
        found = [len(d) for d in drafts]
        longest = max(found, default=0)
        matrix = [d + b + [0] * (longest + 1 - len(d) - len(b)) for d, b in zip(drafts, bonus, strict=True)]
        tokens = torch.tensor(matrix, dtype=torch.long, device=batch.device)  # [B, k+1]
        counts = torch.tensor(found, dtype=torch.long, device=batch.device)  # [B]
        drafted_bonus = torch.tensor([bool(b) for b in bonus], device=batch.device) if sampled else None  # [B]
        return Proposal(tokens, counts, ProposalHost(lengths=found), bonus_drafted=drafted_bonus,
                        draft_forwards=forwards, draft_width=width)

    def _row(self, row: Sequence, n: int, chain: list[int]) -> tuple[list[int], int, int]:
        """Row ``row``'s drafts (at most ``n``: ``chain``, then the draft model's), the draft forwards it ran and the
        tokens its first forward read."""
        if len(chain) >= n:
            return chain, 0, 0
        if row.draft_text is None:
            row.draft_text = DraftText.start(self.bridge, BatchKVCache.for_model(self.model))
        state = row.draft_text
        feed = state.sync(self.bridge, Window.of(row.prompt, row.output, state.commit[0]), chain)
        width, steps = len(feed), n - len(chain)
        if len(state.ids) + steps > self.positions:  # past the draft's positions: the target goes on alone
            return chain, 0, 0
        drafted = []
        for _ in range(steps):
            token = self._next(state.cache, feed)
            state.fed(feed)
            drafted.append(token)
            feed = [token]
        text = state.continuation(self.bridge, drafted)
        return chain + self.bridge.to_target(text)[:steps], steps, width

    def _next(self, cache: BatchKVCache, tokens: list[int]) -> int:
        """The draft's greedy token after reading ``tokens`` into ``cache`` (one row)."""
        start, end = cache.length, cache.length + len(tokens)
        inputs = torch.tensor([tokens], dtype=torch.long, device=self.device)  # [1, q]
        positions = torch.arange(start, end, device=self.device)[None]  # [1, q]
        forward = integer_forward(self.model)
        if forward is not None:
            pad = torch.zeros(1, dtype=torch.long, device=self.device)  # [1]
            visible = visible_keys(positions[0], pad, end, self.window)  # [1, 1, q, end]
            logits = forward.logits(inputs, positions, visible, cache, 1, self.vocabulary)  # [1, 1, V]
        else:
            call = {"input_ids": inputs, "position_ids": positions, cache_keyword(self.model): cache}
            logits = self.model(**call, use_cache=True, logits_to_keep=1).logits  # [1, 1, V]
        return int(logits[0, -1].argmax())

    def cached_after(self, batch: BatchState, proposal: Proposal, accepted: list[int]) -> list[int]:
        return batch.host.draft_cached
