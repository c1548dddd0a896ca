"""The round loop: prefill → realign → propose → verify → accept. Schedulers choose the rows of every round.

Greedy rows take the greedy path (argmax drafts, :func:`~batchspec.engine.verifier.verify_greedy`); rows with
temperature > 0 sample losslessly (sampled drafts with their ``q``, the target's warped ``p``,
:func:`~batchspec.engine.verifier.verify_sampling`), with random numbers keyed by each row's seed and output position.
Rows of one round may each have their own sampling settings.

:func:`build_engine` is the one place that checks a model pair, resolves the EOS and pad defaults and sets up
the stats and the stage timer, for ``batchspec.generate`` and the server alike.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import replace

import torch

from batchspec.config import ProposerKind, SpecConfig
from batchspec.engine.controller import AdaptiveLength, FixedLength, Reach, RoundRecord
from batchspec.engine.graphs import graph_mode
from batchspec.engine.kv_cache import Slab
from batchspec.engine.metrics import GenerationStats, StageTimer
from batchspec.engine.prefill import ChunkBudget, Reader, catch_up, length_groups
from batchspec.engine.proposers import NoDraftProposer, Proposal, ProposalHost, ProposalPlan, Proposer, point_masses
from batchspec.engine.proposers.draft import DraftModelProposer
from batchspec.engine.proposers.ngram import NgramProposer
from batchspec.engine.realign import assemble, draft_catch_up, layout_columns, plan_layout
from batchspec.engine.runner import Floats, ModelRunner
from batchspec.engine.sampling import RoundSampling, RowParams, RowRandom, warp_rows
from batchspec.engine.state import BatchState, KVLocation, Sequence
from batchspec.engine.verifier import Verdict, verify_greedy, verify_sampling
from batchspec.model_checks import check_pair


class Engine:
    """Runs rounds of the target and (for speculative methods) the draft over rows a scheduler picks."""

    def __init__(self, target: torch.nn.Module, draft: torch.nn.Module | None, config: SpecConfig) -> None:
        self.target = target
        self.draft = draft
        self.config = config
        self.stats = GenerationStats()
        self.device = next(target.parameters()).device
        models = (target,) if draft is None else (target, draft)
        self.runner = ModelRunner(self.device, graphs=graph_mode(config.cuda_graphs, self.device, models))
        self.timer = StageTimer(self.stats, enabled=config.timing, device=self.device)
        self.eos = frozenset(config.eos_token_ids)
        self.proposer = _proposer(draft, config)
        self.layers = (_num_layers(target), _num_layers(draft) if self.proposer.uses_draft_model else None)
        self.planner = _planner(target, draft if self.proposer.uses_draft_model else None, config)
        self.chunks = ChunkBudget(config.prefill_chunk)

    def step(self, rows: list[Sequence]) -> None:
        """One round over ``rows`` (unfinished, at most ``batch_size``): read what prompts it may, then decode
        the rows that are ready. Finished rows release their KV."""
        ready = self.prefill(rows)
        if ready:
            self.decode(ready)

    def decode(self, rows: list[Sequence]) -> None:
        """One round: plan on the host, propose and verify on the device, and read the verdict back once."""
        reach = self.proposer.reach(rows, self.planner.limit)
        lengths = self.planner.lengths(rows, reach, any(not row.sampling.greedy for row in rows))
        if self.proposer.uses_draft_model and _model_drafts(lengths, reach, rows):
            self.sync_draft(rows)
        started = time.perf_counter()
        with self.timer.stage("realign"):
            batch, sampling, plan = self.stage_round(rows, lengths)
        with self.timer.stage("draft"):
            drafting = self.runner.mark()
            proposal = self.proposer.propose(batch, plan, sampling, self.runner)
            drafted = self.runner.mark()
        with self.timer.stage("verify"):
            verdict = self.verify(batch, proposal, sampling)
        with self.timer.stage("other"):
            accepted, gained, host = self.accept(batch, proposal, verdict)
            seconds = time.perf_counter() - started  # right on CUDA too: accept waited for the device
            proposing = self.runner.seconds(drafting, drafted)  # device time of the drafts (events done by now)
            record = _record(replace(proposal, host=host), accepted, gained, reach, sampling, seconds, proposing)
            self.planner.observe(rows, record)
            self.chunks.decoded(seconds)
        if self.config.check_invariants:
            for row in rows:
                if not row.finished:
                    row.check_location()

    def prefill(self, rows: list[Sequence]) -> list[Sequence]:
        """Read the prompts of rows that are not ready (a prompt read in chunks first, at most
        ``config.prefill_chunk`` columns while other rows decode; read whole, rows of similar length together);
        returns the rows ready to decode, in order."""
        unread = [row for row in rows if not row.ready]
        if unread:
            group = [row for row in unread if row.kv is not None] or unread
            limit = self.chunks.limit(len(group)) if len(unread) < len(rows) else None
            readers = [Reader(self.target)]
            if self.proposer.uses_draft_model and self.planner.drafting:
                readers.append(Reader(self.draft, draft=True))
            held = sum(_target_cached(row) for row in group)
            started = time.perf_counter()
            for part in [group] if limit is not None else length_groups(group):
                self._catch_up(part, readers, limit)
            self.chunks.read(sum(_target_cached(row) for row in group) - held, time.perf_counter() - started)
        return [row for row in rows if row.ready]

    def sync_draft(self, rows: list[Sequence]) -> None:
        """Before the draft runs: rows whose draft lags so far that the others would re-read much (they joined
        while the draft was idle) read what they lack, apart (see :func:`~batchspec.engine.realign.draft_catch_up`)."""
        lagging = draft_catch_up(rows)
        if lagging:
            self._catch_up([rows[i] for i in lagging], [Reader(self.draft, draft=True)], None)

    def _catch_up(self, rows: list[Sequence], readers: list[Reader], limit: int | None) -> None:
        read = dict(limit=limit, filler=self.config.pad_token_id, layers=self.layers)
        with self.timer.stage("prefill"):
            reading = catch_up(rows, readers, self.runner, **read)
        self.stats.prefill_chunks += 1
        self.stats.recomputed_columns += reading.recomputed
        for draft, tokens in reading.tokens.items():
            self.planner.read(tokens, reading.seconds[draft], draft=draft)

    def stage_round(
        self, rows: list[Sequence], lengths: list[int]
    ) -> tuple[BatchState, RoundSampling | None, ProposalPlan]:
        """Plan the round on the host — the layout (see ``realign.py``), the sampling rows, the proposal — and stage
        all their numbers in the round's one host→device copy; then lay the rows out (reusing their slab when they
        are in lockstep). Returns the batch, the sampling (None when every row is greedy) and the proposal's plan with
        its columns staged."""
        layout = plan_layout(rows)
        plan = self.proposer.plan(rows, lengths)
        parts = (layout_columns(layout, rows, self.layers), _sampling_columns(rows), plan.columns)
        staged = self.runner.stage(*(column for part in parts for column in part))
        cut = [len(parts[0]), len(parts[0]) + len(parts[1])]
        with self.timer.gathering(active=layout.reuse is None):
            batch = assemble(layout, rows, staged[: cut[0]], filler=self.config.pad_token_id, layers=self.layers)
        self.stats.record_layout(
            size=len(rows), padded=layout.padded, copied=layout.reuse is None, recomputed=layout.recomputed
        )
        if self.config.check_invariants:
            batch.check()
        return batch, _round_sampling(rows, staged[cut[0] : cut[1]]), plan.staged_as(staged[cut[1] :])

    def verify(self, batch: BatchState, proposal: Proposal, sampling: RoundSampling | None) -> Verdict:
        """Target forward over the pending token followed by the drafts ``d_1 .. d_k``; greedy acceptance, and for
        sampling rows speculative sampling against the warped target distribution ``p``."""
        cache = batch.slab.target
        k = proposal.k
        inputs = torch.cat([batch.tokens[:, cache.length :], proposal.tokens[:, :k]], dim=1)  # [B, 1 + k]
        target_logits = self.runner.logits(self.target, batch, cache, inputs, keep=k + 1)  # [B, k+1, V]
        verdict = verify_greedy(proposal.tokens[:, :k], target_logits, proposal.lengths)
        if sampling is None:
            return verdict
        rows = sampling.index  # [s]
        p = warp_rows(target_logits[rows], sampling.params.select(rows))  # [s, k+1, V] float64
        q = point_masses(proposal.tokens[rows], p.shape[-1]) if proposal.q is None else proposal.q[rows]
        bonus = None if proposal.bonus_drafted is None else proposal.bonus_drafted[rows]
        if bonus is None:
            bonus = torch.zeros_like(rows, dtype=torch.bool)
        rand = sampling.rand.select(rows)
        sampled = verify_sampling(proposal.tokens[rows], q, p, rand, proposal.lengths[rows], bonus)
        return Verdict(
            accepted=verdict.accepted.index_copy(0, rows, sampled.accepted),
            tokens=verdict.tokens.index_copy(0, rows, sampled.tokens),
        )

    def accept(
        self, batch: BatchState, proposal: Proposal, verdict: Verdict
    ) -> tuple[list[int], list[list[int]], ProposalHost]:
        """Read the verdict back (the round's one device→host read, with the proposal's lookup positions where the
        host does not know them), append each row's gained tokens (cut at EOS or budget) and record where its KV now
        lives. Returns, per row, the drafts accepted and the tokens gained, and the proposal as the host now knows
        it."""
        mask = () if proposal.lookup_mask is None else (proposal.lookup_mask,)
        read = self.runner.fetch(verdict.accepted, verdict.tokens, *mask)  # [B][1 + k+1 (+ k+1)]: the sync
        accepted = [values[0] for values in read]
        gained = [values[1 : values[0] + 2] for values in read]
        host = proposal.host
        if mask:
            looked_up = [[bool(found) for found in values[2 + proposal.k :]] for values in read]
            host = replace(host, looked_up=looked_up)
        slab = Slab(torch.cat([batch.tokens, verdict.tokens], dim=1), batch.slab.target, batch.slab.draft)
        draft_cached = self.proposer.cached_after(batch, proposal, accepted)
        for i, (row, tokens, pad) in enumerate(zip(batch.rows, gained, batch.host.pad, strict=True)):
            self.stats.generated_tokens += row.append(tokens, self.eos)
            if not row.finished:
                row.kv = KVLocation(slab, i, start=pad, target_cached=row.content_len - 1, draft_cached=draft_cached[i])
        self.stats.record_round(accepted, proposal.host.lengths)
        return accepted, gained, host


def build_engine(target: torch.nn.Module, draft: torch.nn.Module | None, config: SpecConfig) -> Engine:
    """The engine for ``config`` on this pair: checks the models, fills in the EOS and pad defaults from the
    target's generation config (the one place they are resolved) and makes the stats and the timer."""
    proposer = config.proposer or (ProposerKind.HYBRID if draft is not None else ProposerKind.NGRAM)
    config = replace(config, proposer=proposer)
    check_pair(target, draft if config.uses_draft_model else None)
    if config.uses_draft_model and draft is None:
        raise ValueError(
            f"proposer {proposer.value!r} needs a draft model; pass one, or use proposer='ngram' or "
            "method='autoregressive'"
        )
    eos, pad = resolve_special_ids(target, config.eos_token_ids, config.pad_token_id)
    draft_model = draft if config.uses_draft_model else None
    return Engine(target, draft_model, replace(config, eos_token_ids=eos, pad_token_id=pad))


def resolve_special_ids(
    target: torch.nn.Module, eos_token_id: int | Seq[int] | None, pad_token_id: int | None
) -> tuple[tuple[int, ...], int]:
    """``(eos ids, pad id)``: the given values, else the target's generation config (what its own ``generate``
    stops at); the pad id then falls back to the model config, the first EOS id and 0 (it is only a filler:
    padding is tracked by lengths)."""
    generation_config = getattr(target, "generation_config", None)
    if eos_token_id is None:
        eos_token_id = getattr(generation_config, "eos_token_id", None)
    eos = () if eos_token_id is None else (eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id)
    if pad_token_id is None:
        sources = (generation_config, getattr(target, "config", None))
        candidates = [getattr(s, "pad_token_id", None) for s in sources] + list(eos[:1])
        pad_token_id = next((p for p in candidates if isinstance(p, int)), 0)
    return tuple(int(e) for e in eos), int(pad_token_id)


def _proposer(draft: torch.nn.Module | None, config: SpecConfig) -> Proposer:
    """The proposer of ``config`` (``config.proposer`` is resolved by :func:`build_engine`)."""
    if not config.speculative:
        return NoDraftProposer()
    lookup = NgramProposer(config.ngram_min, config.ngram_max)
    if config.proposer is ProposerKind.NGRAM:
        return lookup
    return DraftModelProposer(draft, lookup=lookup if config.proposer is ProposerKind.HYBRID else None)


def _planner(target: torch.nn.Module, draft: torch.nn.Module | None, config: SpecConfig):
    """Fixed ``k``, or the adaptive planner with the draft's share of the pair's parameters as its cost prior."""
    if not config.speculative:
        return FixedLength(0)
    if not config.adaptive:
        return FixedLength(config.num_draft_tokens)
    ratio = 0.0 if draft is None else _parameters(draft) / _parameters(target)
    return AdaptiveLength(config.max_draft_tokens, ratio)


def _sampling_columns(rows: list[Sequence]) -> tuple:
    """Host columns of the rows' sampling (none when every row is greedy): seeds, output offsets, top-k, the
    sampling rows, temperatures and top-p."""
    if all(row.sampling.greedy for row in rows):
        return ()
    columns = RowParams.columns([row.sampling for row in rows])
    return (
        [row.seed for row in rows],
        [len(row.output) for row in rows],
        columns["top_k"],
        [i for i, row in enumerate(rows) if not row.sampling.greedy],
        Floats(columns["temperature"]),
        Floats(columns["top_p"]),
    )


def _round_sampling(rows: list[Sequence], staged: tuple[torch.Tensor, ...]) -> RoundSampling | None:
    """Each row's sampling settings, seed and output offset from the staged :func:`_sampling_columns`; None when
    every row is greedy."""
    if not staged:
        return None
    seeds, offsets, top_k, index, temperature, top_p = staged
    params = RowParams(temperature, top_k, top_p, **RowParams.flags([row.sampling for row in rows]))
    sampled = tuple(i for i, row in enumerate(rows) if not row.sampling.greedy)
    return RoundSampling(params=params, rand=RowRandom(seeds=seeds, offsets=offsets), rows=sampled, index=index)


def _record(
    proposal: Proposal,
    accepted: list[int],
    gained: list[list[int]],
    reach: Reach,
    sampling: RoundSampling | None,
    seconds: float,
    proposing: float,
) -> RoundRecord:
    """What the planner learns from a round (lookup drafts checked for free in rows that proposed nothing)."""
    lengths = proposal.host.lengths
    looked_up = proposal.host.looked_up or [[False] * (proposal.k + 1)] * len(lengths)
    first = reach.first or [None] * len(lengths)
    greedy = [True] * len(lengths) if sampling is None else sampling.greedy_rows(len(lengths))
    shadow = [
        None if n or token is None or not plain else token == got[0]
        for n, token, got, plain in zip(lengths, first, gained, greedy, strict=True)
    ]
    return RoundRecord(lengths, accepted, looked_up, shadow, proposal.k, proposal.draft_forwards, seconds, proposing)


def _model_drafts(lengths: list[int], reach: Reach, rows: list[Sequence]) -> bool:
    """Whether the draft model may run this round: a row drafts past its lookups, or a row samples (its bonus
    position is drafted)."""
    sampling = any(not row.sampling.greedy for row in rows)
    return sampling or any(n > found for n, found in zip(lengths, reach.lookups, strict=True))


def _target_cached(row: Sequence) -> int:
    return 0 if row.kv is None else row.kv.target_cached


def _parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _num_layers(model: torch.nn.Module) -> int:
    return model.config.get_text_config().num_hidden_layers
