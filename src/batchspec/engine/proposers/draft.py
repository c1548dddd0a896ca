"""Drafting with a small causal LM whose KV cache (``batch.slab.draft``) lives across rounds, optionally with
prompt lookup first (the hybrid proposer)."""

from __future__ import annotations

from dataclasses import replace

import torch

from batchspec.engine.draft_length import Reach
from batchspec.engine.errors import InvariantError
from batchspec.engine.grammar import DraftGuide
from batchspec.engine.lookup import lookup_on_device
from batchspec.engine.proposers import Proposal, ProposalHost, ProposalPlan
from batchspec.engine.proposers.ngram import NgramProposer
from batchspec.engine.runner import ModelRunner
from batchspec.engine.sampling import RoundSampling, Stream, sample_draft, warp_rows
from batchspec.engine.state import BatchState, Sequence

# the shortest suffix a greedy row's lookup past a draft model's draft matches: it takes the place of the model's next
# draft, so it must copy. On SpecBench at one row (int8, the preset pair; scripts/one_row_replay.py) a suffix of 1
# token, the lookup's own minimum, found a draft after nearly every model draft and the planner counted them as the
# model's later drafts: 0.5 of them were accepted where the model's own are 0.65-0.75 (its first lookup drafts
# 0.1-0.3), and the planner drafted less for it; with 3, 1.3% more tokens per second over the seven categories, 1.6%
# beside the planner's pricing of a row alone (draft_length.AdaptiveLength._trust)
PAST_MODEL_NGRAM = 3


def past_model_n_min(n_min: int, n_max: int) -> int:
    """The shortest suffix a greedy row's lookup past a model draft matches, for a lookup of ``n_min .. n_max``."""
    return max(n_min, min(PAST_MODEL_NGRAM, n_max))


class DraftModelProposer:
    """Drafts ``d_1 .. d_k`` (``k`` = the longest row's length) for every row of the batch at once.

    The draft first re-reads the columns its cache lacks (``draft_len .. L-1``, at least the pending token),
    then feeds back each drafted token: ``k`` forwards for ``k`` tokens. The cache then holds every real column,
    the pending token and ``d_1 .. d_{k-1}``; ``d_k`` matters only when all ``k`` are accepted, and is re-read in
    the next round. When a row samples, one more forward drafts the bonus position of the longest rows (shorter
    rows draw theirs at the step after their last draft). A round in which no row drafts leaves the draft idle
    and its cache as it was: it catches up when it next runs.

    With ``lookup`` (the hybrid proposer) every position is first looked up in the row's own text
    (:mod:`batchspec.engine.lookup`) and the draft model fills only the positions where the lookup finds nothing. A
    row's lookups up to its first miss are its lookup chain, found on the host when the round is planned; after the
    draft model drafts a position, the row's next lookups go on from the drafted token, on the device
    (:func:`~batchspec.engine.lookup.lookup_on_device`), so nothing is read back; such a lookup takes the place of the
    model's own draft, and in a greedy row needs a suffix of :data:`PAST_MODEL_NGRAM` tokens (a sampling row's draft
    at a position must not depend on where the round began: :class:`_RoundDrafts`). A step runs no draft forward when
    every row that needs it has a chain draft there (its tokens are fed at the next forward), so the draft's cache stays
    right for every row. Lookup drafts of sampling rows have a one-hot ``q``; which positions were looked up is read
    back with the round's verdict.
    """

    uses_draft_model = True
    model_prior = None  # the planner's (draft_length.FIRST_PRIOR: measured with the preset's pair)

    def __init__(self, model: torch.nn.Module, lookup: NgramProposer | None = None, vocabulary: int = 0) -> None:
        self.model = model
        self.lookup = lookup
        self.vocabulary = vocabulary  # the draft proposes among the first token ids only (SpecConfig.draft_vocabulary)

    def reach(self, rows: list[Sequence], limit: int) -> Reach:
        lag = [row.content_len - 1 - (row.kv.draft_cached if row.kv else 0) for row in rows]
        if self.lookup is None:
            return Reach(lookups=[0] * len(rows), uses_draft_model=True, lag=lag)
        return replace(self.lookup.reach(rows, limit), uses_draft_model=True, lag=lag)

    def plan(self, rows: list[Sequence], lengths: list[int]) -> ProposalPlan:
        """Columns: the lengths ``[B]``, and with lookup the chains ``[B, k+1]`` (0 past a chain's end) and their
        lengths ``[B]``."""
        host = ProposalHost(lengths=lengths)
        if self.lookup is None:
            return ProposalPlan(host, columns=(lengths,))
        k = max(lengths, default=0)
        chains = self.lookup.chains(rows, k + 1)
        matrix = [chain + [0] * (k + 1 - len(chain)) for chain in chains]  # [B, k+1]
        found = [len(chain) for chain in chains]
        return ProposalPlan(host, columns=(lengths, matrix, found), lookups=found)

    def propose(
        self, batch: BatchState, plan: ProposalPlan, sampling: RoundSampling | None, runner: ModelRunner
    ) -> Proposal:
        lengths = plan.host.lengths
        k = max(lengths, default=0)
        sampled = sampling is not None and sampling.any_sampled
        steps = k + int(sampled)
        drafts = _RoundDrafts(batch, plan, self.lookup, sampling.sampled if sampled else None)
        if steps == 0:
            return drafts.proposal(plan.host)
        needed = _needed(lengths, sampling.rows if sampled else (), steps)
        step_sampling = sampling if sampled else None
        q, runs = None, []
        inputs = batch.tokens[:, batch.slab.draft.length :]  # [B, L - draft_len]: columns the draft lacks
        width = 0
        guide = _guide(batch.rows)
        for j in range(steps):
            if drafts.past_chains(j, needed):
                drafts.look_up(j, read=runner.free_reads)
            if drafts.chained(j, needed):
                inputs = torch.cat([inputs, drafts.tokens[:, j : j + 1]], dim=1)  # fed at the next forward
            else:
                if not runs:
                    _check_caught_up(batch)
                    width = inputs.shape[1]
                drafted, q = self._model_step(batch, inputs, runner, (drafts.tokens.shape, q, j, guide), step_sampling)
                drafts.fill(j, drafted)
                inputs = drafts.tokens[:, j : j + 1]
                runs.append(j)
            if guide is not None:
                guide.follow(drafts.tokens[:, j].tolist())  # a read of the device: grammar rows only
        if guide is not None:
            guide.finish()
        kept = dict(draft_fed=max(runs, default=None), draft_forwards=len(runs), draft_width=width)
        if not sampled:
            return drafts.proposal(plan.host, **kept)
        if q is not None and self.lookup is not None:
            _point_masses_at_lookups(q, drafts.tokens, drafts.looked_up)
        return drafts.proposal(plan.host, q=q, bonus_drafted=sampling.sampled, **kept)

    def _model_step(
        self,
        batch: BatchState,
        inputs: torch.Tensor,
        runner: ModelRunner,
        at: tuple[torch.Size, torch.Tensor | None, int, DraftGuide | None],
        sampling: RoundSampling | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One draft forward over ``inputs``: ``[B]`` its argmax, or for sampling rows a draw from their ``q_j``,
        and ``q`` ``[B, k+1, V]`` with ``q_j`` filled in (None when no row samples). ``at`` is the drafts' shape, ``q``
        so far, the position ``j`` and the grammar rows' guide (their refused tokens are never drafted)."""
        shape, q, j, guide = at
        logits = runner.logits(self.model, batch, batch.slab.draft, inputs, keep=1, vocabulary=self.vocabulary)
        logits = logits[:, -1]  # [B, V]
        if guide is not None:
            logits = guide.mask(logits)
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


def _guide(rows: list[Sequence]) -> DraftGuide | None:
    """The guide of the round's grammar rows (None when no row has a grammar)."""
    states = {i: row.grammar_state() for i, row in enumerate(rows) if row.grammar is not None}
    return DraftGuide(states) if states else None


def _check_caught_up(batch: BatchState) -> None:
    """The draft's first forward of a round feeds the columns after ``draft_len`` for every row: a row whose draft
    holds fewer (it lags) would attend to columns it never read."""
    columns = zip(batch.host.pad, batch.host.draft_cached, strict=True)
    lagging = [i for i, (pad, held) in enumerate(columns) if pad + held < batch.draft_len]
    if lagging:
        raise InvariantError(f"rows {lagging} lag behind the draft's {batch.draft_len} columns; catch them up first")


def _needed(lengths: list[int], sampling: tuple[int, ...], steps: int) -> list[list[bool]]:
    """Per row, the positions whose draft it uses: its first ``lengths[i]``, and for a sampling row the bonus
    position after them. Where every row's needed draft was looked up, the draft model skips that step.

    Example: lengths ``[2, 0]``, row 1 samples, 3 steps → ``[[T, T, F], [T, F, F]]``.
    """
    sampled = set(sampling)
    return [[j < n or (i in sampled and j == n) for j in range(steps)] for i, n in enumerate(lengths)]


class _RoundDrafts:
    """One round's drafts as they are chosen: ``tokens`` ``[B, k+1]`` and, with lookup, which positions were looked
    up, ``looked_up`` ``[B, k+1]`` (bool). Both start as the rows' lookup chains (staged by the plan); a position
    past a row's chain is looked up on the device from the drafts before it (:meth:`look_up`), else drafted by the
    model (:meth:`fill`).

    A lookup past a model draft matches a suffix of :data:`PAST_MODEL_NGRAM` tokens or more in a greedy row, whose
    output is the target's whatever its drafts. A sampling row's tokens follow its drafts' ``q``, and they must not
    depend on the batch or ``k`` (:mod:`batchspec.engine.sampling`): its draft at a position must be the same whether
    the position begins a round (the lookup chain, from the lookup's own minimum) or follows a model draft, so it
    keeps the lookup's own minimum there too (``sampled`` ``[B]``: the rows that sample; None: none does).

    Example: row 0's text ends ``.. 3 5`` and its chain is ``[5]``; the model drafts 9 at position 1; the lookup of
    position 2 over the row's text then ``5 5 9`` finds 4 (the text held ``5 5 9 4``): ``tokens[0] = [5, 9, 4]``,
    ``looked_up[0] = [T, F, T]``.
    """

    def __init__(self, batch: BatchState, plan: ProposalPlan, lookup: NgramProposer | None,
                 sampled: torch.Tensor | None = None) -> None:
        self.batch, self.lookup = batch, lookup
        self.n_min: int | torch.Tensor = 0  # [B] where a row samples
        if lookup is not None:
            self.n_min = past_model_n_min(lookup.n_min, lookup.n_max)
            if sampled is not None:
                self.n_min = torch.where(sampled, lookup.n_min, self.n_min)  # [B]
        self.lengths = plan.staged[0]  # [B]
        self.chain_lengths = plan.lookups or [0] * batch.size  # host copy of self.found
        self.hits: dict[int, list[bool]] = {}  # position → rows whose device lookup found a draft, where read
        k = max(plan.host.lengths, default=0)
        if lookup is None:
            self.tokens = batch.tokens.new_zeros((batch.size, k + 1))  # [B, k+1]
            self.looked_up = None
            return
        chains, self.found = plan.staged[1:]  # [B, k+1], [B]
        self.tokens = chains.clone()  # [B, k+1]
        positions = torch.arange(k + 1, device=chains.device)  # [k+1]
        self.looked_up = positions[None, :] < self.found[:, None]  # [B, k+1]

    def chained(self, j: int, needed: list[list[bool]]) -> bool:
        """Whether every row that needs position ``j`` has a lookup draft there that the host knows of (its chain's,
        or a device lookup's that was read): the draft model skips step ``j``."""
        hits = self.hits.get(j, [False] * len(needed))
        rows = zip(needed, self.chain_lengths, hits, strict=True)
        return all(not need[j] or j < n or hit for need, n, hit in rows)

    def past_chains(self, j: int, needed: list[list[bool]]) -> bool:
        """Whether a row needs position ``j`` after the draft model drafted one of its earlier positions (where its
        chain ended): its lookup of ``j`` runs on the device."""
        if self.lookup is None:
            return False
        return any(need[j] and j > n for need, n in zip(needed, self.chain_lengths, strict=True))

    def look_up(self, j: int, read: bool) -> None:
        """Look up position ``j`` (> 0) of the rows past their chains, from their text and drafts ``< j`` (a suffix of
        :attr:`n_min` tokens or more, a row's own where rows sample). With
        ``read`` (where reading the device back costs no synchronisation: the CPU) the host reads which rows found
        one, so that a step where all did skips the draft forward; on a GPU the forward runs instead of a wait."""
        text = torch.cat([self.batch.tokens, self.tokens[:, :j]], dim=1)  # [B, L + j]
        draft, hit = lookup_on_device(text, self.batch.pad, self.n_min, self.lookup.n_max)  # [B], [B]
        hit &= self.found < j
        self.tokens[:, j] = torch.where(hit, draft, self.tokens[:, j])
        self.looked_up[:, j] |= hit
        if read:
            self.hits[j] = hit.tolist()  # a read, free on the CPU

    def fill(self, j: int, drafted: torch.Tensor) -> None:
        """The model's drafts ``[B]`` at position ``j``, where the lookup found none."""
        if self.looked_up is None:
            self.tokens[:, j] = drafted
        else:
            self.tokens[:, j] = torch.where(self.looked_up[:, j], self.tokens[:, j], drafted)

    def proposal(self, host: ProposalHost, **kept) -> Proposal:
        return Proposal(self.tokens, self.lengths, host, **kept)


def _point_masses_at_lookups(q: torch.Tensor, tokens: torch.Tensor, looked_up: torch.Tensor) -> None:
    """Give every lookup draft a one-hot ``q`` (``q`` ``[B, k+1, V]``, in place; ``tokens``, ``looked_up``
    ``[B, k+1]``). Only sampling rows read their ``q``."""
    q.mul_(~looked_up[..., None])  # [B, k+1, V]: zero where looked up
    q.scatter_add_(-1, tokens[..., None], looked_up[..., None].to(q.dtype))  # 1 at the lookup draft


def _q_dtype(logits_dtype: torch.dtype) -> torch.dtype:
    """float32 for half, bfloat16 and float32 drafts, float64 for float64 ones: q is ``[B, k+1, V]`` for a whole
    round, so it is not kept in float64 unless the draft computes in float64."""
    return torch.promote_types(logits_dtype, torch.float32)
