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
from itertools import accumulate

import torch

from batchspec.config import ProposerKind, SamplingParams, SpecConfig
from batchspec.engine.draft_length import Reach, RoundRecord, planner_for
from batchspec.engine.graphs import GraphMode, check_graphed, graph_mode
from batchspec.engine.kv_cache import Slab
from batchspec.engine.logprobs import MAX_TOP, TokenLogprob, scored, unpacked
from batchspec.engine.metrics import GenerationStats, StageTimer
from batchspec.engine.prefill import ChunkBudget, Reader, Reading, catch_up, length_groups, prompt_logprobs
from batchspec.engine.prefix_cache import PrefixCache, prefix_cache_bytes
from batchspec.engine.proposers import NoDraftProposer, Proposal, ProposalPlan, Proposer, point_masses
from batchspec.engine.proposers.draft import DraftModelProposer
from batchspec.engine.proposers.ngram import NgramProposer
from batchspec.engine.proposers.text import TextDraftProposer
from batchspec.engine.realign import LEFT_SLACK, assemble, draft_catch_up, layout_columns, placed, plan_layout
from batchspec.engine.retokenize import bridge_of
from batchspec.engine.riding import Ride
from batchspec.engine.runner import Floats, ModelRunner
from batchspec.engine.sampling import RoundSampling, RowParams, RowRandom, warp_rows
from batchspec.engine.shaping import shape, shaped_rows
from batchspec.engine.state import BatchState, KVLocation, Sequence
from batchspec.engine.verifier import Verdict, verify_greedy, verify_sampling
from batchspec.model_checks import check_pair, forward_weights, mixture_of

GREEDY = SamplingParams()  # how a riding row chooses its tokens: by fiat, as a greedy row would be told


class Engine:
    """Runs rounds of the target and (for speculative methods) the draft over rows a scheduler picks."""

    def __init__(
        self, target: torch.nn.Module, draft: torch.nn.Module | None, config: SpecConfig, graphs: GraphMode
    ) -> None:
        self.target = target
        self.draft = draft
        self.config = config
        self.stats = GenerationStats()
        self.device = next(target.parameters()).device
        if graphs == "on":
            check_graphed(config.cuda_graphs, (target,) if draft is None else (target, draft))
        self.runner = ModelRunner(self.device, graphs=graphs)
        self.timer = StageTimer(self.stats, enabled=config.timing, device=self.device)
        self.eos = frozenset(config.eos_token_ids)
        self.proposer = _proposer(draft, config)
        self.layers = (_num_layers(target), _num_layers(draft) if self.proposer.uses_draft_model else None)
        drafter = draft if config.uses_draft_model else None
        ragged = self.runner.ragged(target)  # the verification scores each row's own drafts only
        self.slack = LEFT_SLACK if ragged else 0  # padding changes no bit of the fused forward: see realign.py
        share = 0.0 if drafter is None else _draft_share(drafter, target, config, self.runner)
        self.planner = planner_for(config, share, ragged=ragged, mixture=mixture_of(target),
                                   model_prior=self.proposer.model_prior)
        self.chunks = ChunkBudget(config.prefill_chunk)
        self.rides = ragged and config.prefill_chunk is not None  # prompt chunks ride in the rounds: riding.py
        size = prefix_cache_bytes(config.prefix_cache_size, self.device)
        self.prefixes = PrefixCache(size) if size else None

    def step(self, rows: list[Sequence], *, draining: bool = False) -> None:
        """One round over ``rows`` (unfinished, at most ``batch_size``): read what prompts it may, then decode
        the rows that are ready. Finished rows release their KV. ``draining``: no row takes the place of one that
        finishes before the batch ends (:attr:`~batchspec.engine.schedulers.Scheduler.draining`)."""
        self.chunks.begin()
        ready = self.prefill(rows)
        if ready:
            self.decode(ready, draining=draining)

    def decode(self, rows: list[Sequence], *, draining: bool = False) -> None:
        """One round: plan on the host, propose and verify on the device, and read the verdict back once. Rows whose
        prompts are read in the round (:mod:`batchspec.engine.riding`) feed their next prompt tokens instead. The rows
        take the places in the batch that move the fewest of them (:func:`~batchspec.engine.realign.placed`)."""
        rows = placed(rows)
        ride = self.ride(rows)
        reach = ride.closed(self.proposer.reach(rows, self.planner.limit))
        sampled = any(not row.sampling.greedy for row in rows if row.reading is None)
        lengths = self.planner.lengths(rows, reach, sampled, draining=draining, cap=self.chunks.round_cap())
        drafts = self.proposer.uses_draft_model and _model_drafts(lengths, reach, sampled)
        if drafts and not self.sync_draft(rows):  # a row still catches up (every row greedy): lookups only this round
            lengths = [min(n, found) for n, found in zip(lengths, reach.lookups, strict=True)]
        started = time.perf_counter()
        with self.timer.stage("realign"):
            batch, sampling, plan, ride = self.stage_round(rows, lengths, ride)
        realigned = time.perf_counter() - started  # what the last round's unequal gains cost (the planner's r)
        with self.timer.stage("draft"):
            drafting = self.runner.mark()
            proposal = self.proposer.propose(batch, plan, sampling, self.runner)
            drafted = self.runner.mark()
        with self.timer.stage("verify"):
            verdict, scores = self.verify(batch, proposal, sampling, ride)
        with self.timer.stage("other"):
            accepted, gained = self.accept(batch, proposal, verdict, scores, ride)
            seconds = time.perf_counter() - started  # right on CUDA too: accept waited for the device
            proposing = self.runner.seconds(drafting, drafted)  # device time of the drafts (events done by now)
            record = _record(proposal, accepted, gained, reach, sampling, seconds, proposing, ride.extra)
            self.planner.observe(rows, replace(record, seconds=seconds - realigned, realign_seconds=realigned))
            self.chunks.decoded(self.planner.plain_step_s(len(rows), seconds))
            self._keep([rows[i] for i in ride.riding if rows[i].reading is None])
        if self.config.check_invariants:
            for row in rows:
                if not row.finished:
                    row.check_location()

    def prefill(self, rows: list[Sequence]) -> list[Sequence]:
        """Read the prompts of rows that are not ready (a prompt read in chunks first, at most
        ``config.prefill_chunk`` columns while other rows decode; read whole, rows of similar length together);
        returns the rows ready to decode, in order. Rows that ask for prompt logprobs get them first.

        On the fused integer forward a prompt read while other rows decode is read inside their rounds instead
        (:mod:`batchspec.engine.riding`); where no row decodes, what is left of it is read in one round."""
        for row in rows:
            self.score_prompt(row)
        decoding = any(row.ready and row.reading is None for row in rows)
        unread = self._linked([row for row in rows if not row.ready])
        if unread and decoding and self.rides:
            for row in unread:
                row.reading = _target_cached(row) + 1
            unread = []
        if unread:
            held = [row for row in unread if row.kv is not None]
            group = held or unread
            limit = self.chunks.limit(len(group)) if any(row.ready for row in rows) else None
            readers = [Reader(self.target)]
            if self.proposer.uses_draft_model and self.planner.drafting:
                readers.append(Reader(self.draft, is_draft=True))
            cached = sum(_target_cached(row) for row in group)
            started = time.perf_counter()
            parts = length_groups(group) if limit is None else [length_groups(held)[0] if held else group]
            for part in parts:
                self._catch_up(part, readers, limit)
            self.chunks.read(sum(_target_cached(row) for row in group) - cached, time.perf_counter() - started)
            self._keep([row for row in unread if row.ready])
        return [row for row in rows if row.ready]

    def ride(self, rows: list[Sequence]) -> Ride:
        """The prompt columns this round's riding rows feed: together, as many as take about as long as a plain step
        (:meth:`ChunkBudget.ride_budget`), booked against the round's cap; where no row decodes, all they have left."""
        riding = sum(row.reading is not None for row in rows)
        column_s = self.planner.column_s(len(rows))
        ride = Ride.of(rows, None if riding in (0, len(rows)) else self.chunks.ride_budget(column_s))
        self.chunks.rode(ride.extra, column_s)
        self.stats.riding_columns += sum(ride.columns)
        return ride

    def score_prompt(self, row: Sequence) -> None:
        """Fill ``row.prompt_token_logprobs`` (:func:`~batchspec.engine.prefill.prompt_logprobs`) if it asks for
        them and has none yet."""
        if row.prompt_logprobs is not None and row.prompt_token_logprobs is None:
            row.prompt_token_logprobs = prompt_logprobs(self.target, self.runner, row.prompt, row.prompt_logprobs)

    def _linked(self, unread: list[Sequence]) -> list[Sequence]:
        """``unread`` after each new row took the longest prefix the prefix cache holds of its prompt; less the rows
        that wait for an earlier one's prompt (:meth:`~batchspec.engine.prefix_cache.PrefixCache.followers`)."""
        if self.prefixes is None:
            return unread
        for row in unread:
            before = row.cached_tokens
            self.prefixes.link(row)
            self.stats.cached_tokens += row.cached_tokens - before
            self.stats.prefix_hits += before == 0 < row.cached_tokens
        waiting = self.prefixes.followers([row for row in unread if not row.ready])
        pending = [row for row in unread if not row.ready]
        return [row for i, row in enumerate(pending) if i not in waiting]

    def _keep(self, rows: list[Sequence]) -> None:
        """Rows whose prompts were just read feed the prefix cache."""
        if self.prefixes is not None:
            for row in rows:
                self.prefixes.keep(row)

    def sync_draft(self, rows: list[Sequence]) -> bool:
        """Before the draft runs: rows whose draft lags so far that the others would re-read much (they joined
        while the draft was idle) read what they lack, apart (see :func:`~batchspec.engine.realign.draft_catch_up`).

        Where a row has streamed tokens already, a whole prompt read here would be one long gap for every stream, and
        so would a draft's first forward that reads what the rows lack along with its drafts. A round then holds
        within its cap (:meth:`ChunkBudget.round_cap`): the draft's first forward may read no more per row than the
        round re-reads and the cap leaves after the planned decoding (:meth:`ChunkBudget.spare_columns`); rows that
        lack more read at most the draft's share of the round's budget (:meth:`ChunkBudget.catch_up_limit`) apart,
        and the round then drafts only where its planned decoding still fits. Where no row has streamed yet, their
        first token waits anyway, as for prompts, and they read all at once; so do rows of a round where a row
        samples, whose tokens need the draft every round (a seeded row's bonus position is drawn against the draft's
        ``q``: a round without it would draw other tokens). Returns whether the draft may run this round: False while
        a row lags (it would attend to columns it never read) or lacks more than that.

        On SpecBench's served chats at one client, the longest rounds were a catch-up of about 45 columns apart
        followed by a first forward reading as many again (2.7 plain steps and more)."""
        streaming = any(row.output for row in rows) and all(params.greedy for params in _sampling_of(rows))
        far = self._far(rows) if streaming else None
        lagging = draft_catch_up(rows, far=far)
        if not lagging:
            return True
        limit = None if far is None else self.chunks.catch_up_limit(len(lagging))
        reading = self._catch_up([rows[i] for i in lagging], [Reader(self.draft, is_draft=True)], limit)
        self.chunks.caught_up(reading.tokens.get(True, 0), reading.seconds.get(True, 0.0))
        if limit is None:
            return True
        spare = self.chunks.spare_columns(len(rows), self.planner.planned_s)  # the cap less what was just read
        return bool(spare) and not draft_catch_up(rows, far=max(spare, self.planner.limit + 1))

    def _far(self, rows: list[Sequence]) -> int | None:
        """Columns a row's draft may lack before this round's first draft forward, which reads them: what a round
        re-reads (the planner's drafts and the pending token), or more where the round's cap leaves room for them
        after its planned decoding (None: no cap)."""
        spare = self.chunks.spare_columns(len(rows), self.planner.planned_s)
        return None if spare is None else max(spare, self.planner.limit + 1)

    def _catch_up(self, rows: list[Sequence], readers: list[Reader], limit: int | None) -> Reading:
        read = dict(limit=limit, filler=self.config.pad_token_id, layers=self.layers)
        with self.timer.stage("prefill"):
            reading = catch_up(rows, readers, self.runner, **read)
        self.stats.prefill_chunks += 1
        self.stats.recomputed_columns += reading.recomputed
        for draft, tokens in reading.tokens.items():
            self.planner.read(tokens, reading.seconds[draft], draft=draft)
        return reading

    def stage_round(
        self, rows: list[Sequence], lengths: list[int], ride: Ride
    ) -> tuple[BatchState, RoundSampling | None, ProposalPlan, Ride]:
        """Plan the round on the host — the layout (see ``realign.py``), the sampling rows, the proposal, the
        riding prompt columns — and stage all their numbers in the round's one host→device copy; then lay the rows
        out (reusing their slab when they are in lockstep). Returns the batch, the sampling (None when every row is
        greedy), the proposal's plan and the ride, with their columns staged."""
        layout = plan_layout(rows, slack=self.slack)
        plan = self.proposer.plan(rows, lengths)
        parts = (layout_columns(layout, rows, self.layers), _sampling_columns(rows), plan.columns,
                 ride.host_columns())
        staged = self.runner.stage(*(column for part in parts for column in part))
        cut = list(accumulate(len(part) for part in parts))
        with self.timer.gathering(active=layout.reuse is None):
            batch = assemble(layout, rows, staged[: cut[0]], filler=self.config.pad_token_id, layers=self.layers)
        self.stats.record_layout(
            size=len(rows), padded=layout.padded, copied=layout.reuse is None, recomputed=layout.recomputed,
            moved_bytes=batch.moved.bytes, moved_rows=batch.moved.rows,
        )
        if self.config.check_invariants:
            batch.check()
        sampling = _round_sampling(rows, staged[cut[0] : cut[1]])
        return batch, sampling, plan.staged_as(staged[cut[1] : cut[2]]), ride.staged_as(staged[cut[2] :])

    def verify(
        self, batch: BatchState, proposal: Proposal, sampling: RoundSampling | None, ride: Ride
    ) -> tuple[Verdict, torch.Tensor | None]:
        """Target forward over the pending token followed by the drafts ``d_1 .. d_k`` (a row's own
        ``d_1 .. d_{lengths[i]}`` only where the forward is ragged: :meth:`ModelRunner.logits`), with the rows' shaping
        (penalties, bias, grammar: :mod:`batchspec.engine.shaping`); greedy acceptance, and for sampling rows
        speculative sampling against the warped target distribution ``p``; riding rows keep their prompt tokens
        (``ride``). Returns the verdict and, where rows ask for logprobs, their
        :func:`~batchspec.engine.logprobs.scored` ``[B, (k+1)·(1 + 2·MAX_TOP)]``."""
        cache = batch.slab.target
        k = proposal.k
        inputs = torch.cat([batch.tokens[:, cache.length :], proposal.tokens[:, :k]], dim=1)  # [B, 1 + k]
        fed = proposal.lengths + 1 if k or ride.riding else None  # [B]: a row's drafts past its own length are not fed
        raw_logits = self.runner.logits(self.target, batch, cache, ride.inputs(inputs), keep=k + 1,
                                        fed=None if fed is None else ride.fed(fed),
                                        scored=None if fed is None else ride.scored(fed))  # [B, k+1, V]
        target_logits = _shaped(batch, proposal, raw_logits)  # [B, k+1, V]
        verdict = verify_greedy(proposal.tokens[:, :k], target_logits, proposal.lengths)
        if sampling is not None:
            verdict = _sampled(verdict, proposal, sampling, target_logits)
        return ride.decided(verdict), _scores(batch.rows, raw_logits, verdict.tokens)

    def accept(
        self, batch: BatchState, proposal: Proposal, verdict: Verdict, scores: torch.Tensor | None, ride: Ride
    ) -> tuple[list[int], list[list[int]]]:
        """Read the verdict back (the round's one device→host read, with the logprobs rows asked for), append each
        row's gained tokens (cut at EOS or budget), advance their grammars and record where its KV now lives; a
        riding row (``ride``) reads on through its prompt instead. Returns, per row, the drafts accepted and the
        tokens gained (none for a riding row)."""
        logprobs = () if scores is None else (scores,)
        read = self.runner.fetch(verdict.accepted, verdict.tokens, *logprobs)  # [B][1 + k+1 (+ ...)]: the sync
        columns = ride.columns
        accepted = [0 if c else values[0] for c, values in zip(columns, read, strict=True)]
        gained = [[] if c else values[1 : values[0] + 2] for c, values in zip(columns, read, strict=True)]
        tokens = torch.cat([batch.tokens, verdict.tokens], dim=1)  # [B, L + k + 1] (as wide as a ride)
        slab = Slab(tokens, batch.slab.target, batch.slab.draft, holders=tuple(batch.rows))
        draft_cached = self.proposer.cached_after(batch, proposal, accepted)
        scored_from = 1 + verdict.tokens.shape[1]
        for i, (row, tokens, pad) in enumerate(zip(batch.rows, gained, batch.host.pad, strict=True)):
            if columns[i]:  # accepted 0: its draft holds at most the columns it held, and its pending token
                row.read_on(columns[i])
            else:
                kept = row.append(tokens, self.eos)
                self.stats.generated_tokens += kept
                _record_row(row, tokens[:kept], read[i][scored_from:], proposal.k)
            if not row.finished:
                row.kv = KVLocation(slab, i, start=pad, target_cached=row.content_len - 1, draft_cached=draft_cached[i])
        self.stats.record_round(accepted, proposal.host.lengths)
        return accepted, gained


def build_engine(
    target: torch.nn.Module, draft: torch.nn.Module | None, config: SpecConfig, graphs: GraphMode
) -> Engine:
    """The engine for ``config`` on this pair, its runner in the graph mode ``graphs``, both as a run's entry made
    them (``batchspec.run.RunConfig``: the proposer settled, :func:`runner_graphs` asked): checks the models, fills
    in the EOS and pad defaults from the target's generation config (the one place they are resolved) and makes the
    stats and the timer."""
    if config.speculative and config.proposer is None:
        raise ValueError("the proposer is settled at the run's entry (batchspec.run), not left None")
    check_pair(target, draft if config.uses_draft_model else None, same_tokenizer=bridge_of(draft) is None)
    if config.uses_draft_model and draft is None:
        raise ValueError(
            f"proposer {config.proposer.value!r} needs a draft model; pass one, or use proposer='ngram' or "
            "method='autoregressive'"
        )
    eos, pad = resolve_special_ids(target, config.eos_token_ids, config.pad_token_id)
    draft_model = draft if config.uses_draft_model else None
    return Engine(target, draft_model, replace(config, eos_token_ids=eos, pad_token_id=pad), graphs)


def runner_graphs(config: SpecConfig, device: torch.device) -> GraphMode:
    """The runner's graph mode for ``config`` on ``device``: the one place
    :func:`~batchspec.engine.graphs.graph_mode` is asked, by the run's entry (``batchspec.run``) before anything
    loads, so that a ``cuda_graphs`` the device cannot run fails first (ValueError); the engine then checks its
    models against the answer (:func:`~batchspec.engine.graphs.check_graphed`)."""
    return graph_mode(config.cuda_graphs, device)


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
    lookup = lookup if config.proposer is ProposerKind.HYBRID else None
    bridge = bridge_of(draft)
    if bridge is not None:
        return TextDraftProposer(draft, bridge, lookup=lookup, vocabulary=config.draft_vocabulary)
    return DraftModelProposer(draft, lookup=lookup, vocabulary=config.draft_vocabulary)


def _sampling_of(rows: list[Sequence]) -> list[SamplingParams]:
    """How each row chooses its tokens this round: a riding row (reading its prompt) chooses none, as a greedy row
    whose verdict is decided by fiat."""
    return [row.sampling if row.reading is None else GREEDY for row in rows]


def _sampling_columns(rows: list[Sequence]) -> tuple:
    """Host columns of the rows' sampling (none when every row is greedy): seeds, output offsets, top-k, the
    sampling rows, temperatures and top-p."""
    sampling = _sampling_of(rows)
    if all(params.greedy for params in sampling):
        return ()
    columns = RowParams.columns(sampling)
    return (
        [row.row_seed for row in rows],
        [len(row.output) for row in rows],
        columns["top_k"],
        [i for i, params in enumerate(sampling) if not params.greedy],
        Floats(columns["temperature"]),
        Floats(columns["top_p"]),
    )


def _round_sampling(rows: list[Sequence], staged: tuple[torch.Tensor, ...]) -> RoundSampling | None:
    """Each row's sampling settings, seed and output offset from the staged :func:`_sampling_columns`; None when
    every row is greedy."""
    if not staged:
        return None
    seeds, offsets, top_k, index, temperature, top_p = staged
    sampling = _sampling_of(rows)
    params = RowParams(temperature, top_k, top_p, **RowParams.flags(sampling))
    sampled = tuple(i for i, params in enumerate(sampling) if not params.greedy)
    return RoundSampling(params=params, rand=RowRandom(seeds=seeds, offsets=offsets), rows=sampled, index=index)


def _shaped(batch: BatchState, proposal: Proposal, logits: torch.Tensor) -> torch.Tensor:
    """``logits`` ``[B, k+1, V]`` with the shaping of the rows that have some (:mod:`batchspec.engine.shaping`) and
    choose tokens this round (not a riding row's)."""
    rows = [i for i in shaped_rows(batch.rows) if batch.rows[i].reading is None]
    if not rows:
        return logits
    index = torch.tensor(rows, device=logits.device)  # [r]
    lengths = [proposal.host.lengths[i] for i in rows]
    part = shape(logits[index], [batch.rows[i] for i in rows], proposal.tokens[index, : proposal.k], lengths)
    return logits.index_copy(0, index, part)


def _sampled(verdict: Verdict, proposal: Proposal, sampling: RoundSampling, logits: torch.Tensor) -> Verdict:
    """``verdict`` with the sampling rows' outcomes: speculative sampling against the warped ``logits``."""
    rows = sampling.index  # [s]
    p = warp_rows(logits[rows], sampling.params.select(rows))  # [s, k+1, V] float64
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


def _scores(rows: list[Sequence], logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor | None:
    """``[B, (k+1)·(1 + 2·MAX_TOP)]`` the logprobs of the rows that ask for them (zeros elsewhere), or None."""
    asking = [i for i, row in enumerate(rows) if row.logprobs is not None]
    if not asking:
        return None
    index = torch.tensor(asking, device=logits.device)  # [r]
    top = min(MAX_TOP, logits.shape[-1])
    part = scored(logits[index], tokens[index], top).flatten(1)  # [r, (k+1)·(1 + 2·MAX_TOP)]
    return torch.zeros(len(rows), part.shape[1], dtype=part.dtype, device=part.device).index_copy(0, index, part)


def _record_row(row: Sequence, kept: list[int], scores: list[int], k: int) -> None:
    """After ``row`` kept ``kept`` of its gained tokens: advance its grammar and keep their logprobs (``scores``:
    its row of :func:`_scores`, for ``k + 1`` positions)."""
    if row.grammar is not None and kept:
        row.grammar_state().advance(kept)
    if row.logprobs is not None:
        top = (len(scores) // (k + 1) - 1) // 2
        for token, (logprob, alternatives) in zip(kept, unpacked(scores, top, len(kept)), strict=True):
            row.token_logprobs.append(TokenLogprob(token, logprob, alternatives[: row.logprobs]))


def _record(
    proposal: Proposal,
    accepted: list[int],
    gained: list[list[int]],
    reach: Reach,
    sampling: RoundSampling | None,
    seconds: float,
    proposing: float,
    riding: int = 0,
) -> RoundRecord:
    """What the planner learns from a round (lookup drafts checked for free in rows that proposed nothing); riding
    rows proposed nothing, and ``riding`` prompt columns were verified besides."""
    lengths = proposal.host.lengths
    chained = [[j < found for j in range(proposal.k + 1)] for found in reach.lookups]  # as the planner priced them
    first = reach.first or [None] * len(lengths)
    greedy = [True] * len(lengths) if sampling is None else sampling.greedy_rows(len(lengths))
    shadow = [
        None if n or token is None or not plain else token == got[0]
        for n, token, got, plain in zip(lengths, first, gained, greedy, strict=True)
    ]
    return RoundRecord(lengths, accepted, chained, shadow, proposal.k, proposal.draft_forwards, seconds, proposing,
                       draft_width=proposal.draft_width, riding=riding)


def _model_drafts(lengths: list[int], reach: Reach, sampled: bool) -> bool:
    """Whether the draft model may run this round: a row drafts past its lookups, or a row samples (``sampled``: its
    bonus position is drafted)."""
    return sampled or any(n > found for n, found in zip(lengths, reach.lookups, strict=True))


def _target_cached(row: Sequence) -> int:
    return 0 if row.kv is None else row.kv.target_cached


def _draft_share(draft: torch.nn.Module, target: torch.nn.Module, config: SpecConfig, runner: ModelRunner) -> float:
    """The weights a draft forward multiplies by over a target forward's: the planner's prior for the draft's cost
    (its output layer over ``draft_vocabulary`` ids only where the fused integer forward runs it, which honours it)."""
    vocabulary = config.draft_vocabulary if runner.ragged(draft) else 0
    return forward_weights(draft, vocabulary) / forward_weights(target)


def _num_layers(model: torch.nn.Module) -> int:
    return model.config.get_text_config().num_hidden_layers
