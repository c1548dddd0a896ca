"""Reading what a model's cache lacks, apart from the batch that decodes: new prompts, and a lagging draft.

Rows decode together only when the target's KV covers every column but their pending token
(:attr:`~batchspec.engine.state.Sequence.ready`): a batch forward starts at the column the least-read row needs, so one
row without KV would make every other row read its columns again. Rows that lack KV are therefore laid out on
their own and read first:

* **prefill** — the target (and the draft, when it drafts) reads the prompts of new rows, all in one padded
  forward per model; while other rows are decoding, at most ``limit`` columns per round (chunked prefill: a long
  prompt delays the running rows by a bounded amount per round instead of its whole prefill at once). A prompt
  read in chunks finishes before new prompts start, so no chunk reads columns twice.
* **length groups** — prompts read whole are read in groups of similar length (:func:`length_groups`): reading
  is compute-bound, and a padded column costs as much as a real one, so eight prompts of 43 to 208 tokens read as
  one batch would compute 1,664 columns for 590 real ones;
* **prompt logprobs** — a row that asks for them (completions' ``echo``) has its prompt read once more on its own
  by the target, with logits (:func:`prompt_logprobs`), before it joins the batch;
* **draft catch-up** — before the draft runs, rows whose draft cache lags further than the batch's slack (they
  joined while the draft was idle) read the missing columns, and so do rows that lag only once those have caught
  up (:func:`~batchspec.engine.realign.draft_catch_up`). Like a prompt, at most ``limit`` columns per round (the
  draft's share of the round's :class:`ChunkBudget`), where every row is greedy: until every row has caught up, the
  rows decode without the draft model (its forward feeds the same columns for every row, so it cannot run while one
  lags), and a joining row's whole prompt never lands in one round of the running streams. So do rows whose draft
  lacks more than its share of the round (a draft idle for long), which its first forward would otherwise read for
  every row at once. A round where a row samples needs the draft (see ``Engine.sync_draft``) and catches up whole.

Both feed columns up to, not including, each row's pending token, through the decoder only (no logits).

How many columns a chunk reads is a :class:`ChunkBudget`: a fixed number, or ``"auto"``: as many as take about
as long to read as one decode round of the running rows, from the seconds measured so far, so that a running
stream waits about two rounds (the chunk, then its own round) whatever prompt arrives.

Example, ``limit = 4``: rows ``a`` (7 tokens) and ``b`` (3 tokens) are laid out ``[a a a a a a a]`` and
``[_ _ _ _ b b b]``; the first chunk reads columns 0–3 (``b`` has none of its own there), the second columns 4–5;
then both hold every column but their last, and are ready.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from batchspec.config import AUTO
from batchspec.engine.errors import InvariantError
from batchspec.engine.kv_cache import BatchKVCache
from batchspec.engine.logprobs import TokenLogprob, scored, unpacked
from batchspec.engine.realign import assemble, layout_columns, plan_layout
from batchspec.engine.runner import ModelRunner
from batchspec.engine.state import BatchState, KVLocation, Sequence

FIRST_AUTO_CHUNK = 32  # columns of the first chunk, before anything is timed
GROUP_SPREAD = 16  # padding columns a prompt may read to share a forward with longer ones
MIN_AUTO_CHUNK = 8
MAX_RIDE = 64  # prompt columns a round's riding rows feed at most (auto): estimates gone low would make it long
SCORE_CHUNK = 64  # prompt columns per forward of prompt_logprobs: its float64 [1, chunk, V] logprobs stay ~80 MB
TIMING_DECAY = 0.5  # weight of earlier measurements in the running estimates


class ChunkBudget:
    """Columns of new prompts a round may read while other rows decode: ``setting`` columns, all (None), or
    (``"auto"``) the columns that take about as long to read as a plain decode step, from running estimates of the
    seconds a plain step and a read prompt token take. A plain step, not the round: a round whose drafts make it
    longer would otherwise read a longer chunk too, and the gap its rows' clients wait would grow twice.

    The draft's catch-up (a row that joined while the draft was idle: :meth:`~batchspec.engine.core.Engine.sync_draft`)
    draws on the same round's budget, at the draft's own seconds a column, less what the round's prompt reading
    took already (:meth:`begin` starts a round): a round that decodes rows reads at most about one plain step's worth,
    whoever reads it.

    Example: plain steps of 0.06 s and 2.5 ms per prompt token: one new row reads 24 columns per round;
    two new rows read 12 each. A draft at 0.5 ms a column then catches a row up by 120 columns, or by 60 in a round
    whose prompt chunk took 0.03 s.
    """

    def __init__(self, setting: int | str | None) -> None:
        self.setting = setting
        self.round_s: float | None = None
        self.token_s: float | None = None
        self.draft_token_s: float | None = None
        self.spent = 0.0  # seconds this round has read so far

    def limit(self, rows: int) -> int | None:
        """Columns ``rows`` new rows may read this round (None: all). A round reads its prompt chunk first."""
        return self._columns(rows, self.token_s, self.round_s)

    def ride_budget(self, column_s: float | None) -> int | None:
        """Prompt columns this round's verification may read besides its decoding (None: all;
        :mod:`batchspec.engine.riding`): the setting, or (``"auto"``) as many as add about a plain step to the round
        at ``column_s``, what a verified column adds to a round, fitted (None before any round was: a column read
        apart), but never less than a prompt column read apart costs (a fit of the rounds' seconds can take a step's
        cost for its columns'), and at most :data:`MAX_RIDE`."""
        each = max((s for s in (column_s, self.token_s) if s is not None), default=None)
        columns = self._columns(1, each, self.round_s)
        return columns if columns is None or self.setting != AUTO else min(columns, MAX_RIDE)

    def rode(self, columns: int, column_s: float | None) -> None:
        """The round's riding rows add ``columns`` to its verification, at ``column_s`` each (None: a column read
        apart): what the round's decoding may take shrinks by as much (:meth:`round_cap`)."""
        self.spent += columns * (column_s or self.token_s or 0.0)

    def catch_up_limit(self, rows: int) -> int | None:
        """Columns the draft may read for each of ``rows`` rows it catches up this round (None: all): what is left of
        the round's budget once its prompt chunk was read."""
        return self._columns(rows, self.draft_token_s, None if self.round_s is None else self.round_s - self.spent)

    def _columns(self, rows: int, token_s: float | None, seconds: float | None) -> int | None:
        if self.setting != AUTO:
            return self.setting
        if seconds is None or token_s is None:
            return FIRST_AUTO_CHUNK
        return max(MIN_AUTO_CHUNK, round(seconds / (token_s * rows)))

    def spare_columns(self, rows: int, decode_s: float | None) -> int | None:
        """Columns the draft may read for each of ``rows`` rows this round besides its decoding, planned to take
        ``decode_s`` (None: a plain step): what :meth:`round_cap` leaves after it, at the draft's seconds a column
        (None: no cap; a fixed setting: that many columns; before a catch-up was timed, the first chunk's)."""
        cap = self.round_cap()
        if cap is None or self.setting != AUTO:
            return None if cap is None else self.setting
        if self.draft_token_s is None:
            return FIRST_AUTO_CHUNK
        spare = cap - (self.round_s if decode_s is None else decode_s)
        return max(0, round(spare / (self.draft_token_s * rows)))

    def round_cap(self) -> float | None:
        """Seconds this round's decoding may take (None: no bound; the setting unset, or no plain step measured yet):
        what a round of plain decoding takes at worst, its prompt chunk and its step, less what this round read
        already; never less than a plain step. A round that drafts within it makes no stream wait longer than
        plain decoding's chunked rounds do."""
        if self.setting is None or self.round_s is None:
            return None
        chunk = self.round_s if self.setting == AUTO or self.token_s is None else self.setting * self.token_s
        return max(self.round_s, self.round_s + chunk - self.spent)

    def begin(self) -> None:
        """A round starts: nothing read in it yet."""
        self.spent = 0.0

    def decoded(self, seconds: float) -> None:
        """A plain decode step takes about ``seconds`` (the draft-length planner's estimate after each round)."""
        self.round_s = _mix(self.round_s, seconds)

    def read(self, tokens: int, seconds: float) -> None:
        """Reading ``tokens`` prompt tokens (over all rows and models) took ``seconds``."""
        self.spent += seconds
        if tokens > 0:
            self.token_s = _mix(self.token_s, seconds / tokens)

    def caught_up(self, tokens: int, seconds: float) -> None:
        """The draft's catch-up read ``tokens`` columns (over all rows) in ``seconds``."""
        self.spent += seconds
        if tokens > 0:
            self.draft_token_s = _mix(self.draft_token_s, seconds / tokens)


def _mix(estimate: float | None, value: float) -> float:
    return value if estimate is None else TIMING_DECAY * estimate + (1 - TIMING_DECAY) * value


def length_groups(rows: list[Sequence], spread: int = GROUP_SPREAD) -> list[list[Sequence]]:
    """``rows`` in groups to read together: longest first (by the columns each lacks), a row joining the group
    before it while it lacks at most ``spread`` columns fewer than that group's first, so that no row reads more
    than ``spread`` columns of padding and rows of similar length still share a forward. A row that holds target
    columns already (a prefix from the prefix cache, a prompt read in part) joins only a group whose first lacks as
    many: a forward keeps one column count for all its rows, so it would re-read what it holds past that count.

    Example, ``spread = 16``, rows lacking ``[43, 208, 51, 68, 57, 52]`` columns: ``[[208], [68, 57, 52], [51, 43]]``
    (padded columns read: 208 + 3 * 68 + 2 * 51 = 514, against 6 * 208 = 1,248 in one group); if the row lacking 57
    held columns, ``[[208], [68], [57], [52, 51, 43]]``.
    """
    groups: list[list[Sequence]] = []
    for row in sorted(rows, key=_lacking, reverse=True):
        allowed = 0 if row.kv is not None and row.kv.target_cached else spread
        if groups and _lacking(groups[-1][0]) - _lacking(row) <= allowed:
            groups[-1].append(row)
        else:
            groups.append([row])
    return groups


def _lacking(row: Sequence) -> int:
    """Target columns the row lacks before its pending token."""
    return row.content_len - 1 - (row.kv.target_cached if row.kv else 0)


@dataclass(frozen=True)
class Reader:
    """A model and which of a slab's caches it reads into (``is_draft=False``: the target's)."""

    model: torch.nn.Module
    is_draft: bool = False

    def cache(self, batch: BatchState) -> BatchKVCache:
        cache = batch.slab.draft if self.is_draft else batch.slab.target
        if cache is None:
            raise InvariantError("a batch read by the draft carries a draft cache")
        return cache


@dataclass
class Reading:
    """What one :func:`catch_up` did.

    Attributes:
        recomputed: target columns read that rows already held.
        tokens: per model (``draft`` True / False), token positions it read (rows x columns, padding included).
        seconds: per model, the seconds its reading took.
    """

    recomputed: int = 0
    tokens: dict[bool, int] = field(default_factory=dict)
    seconds: dict[bool, float] = field(default_factory=dict)


def catch_up(
    rows: list[Sequence],
    readers: list[Reader],
    runner: ModelRunner,
    *,
    limit: int | None,
    filler: int,
    layers: tuple[int, int | None],
) -> Reading:
    """Lay ``rows`` out on their own and let every reader read at most ``limit`` (None: all) of the columns its
    cache lacks before the pending tokens. Each model's reading is timed to the end of its work on the device
    (on CUDA, one synchronisation per model read)."""
    layout = plan_layout(rows, draft_slack=None)
    staged = runner.stage(*layout_columns(layout, rows, layers))
    batch = assemble(layout, rows, staged, filler=filler, layers=layers)
    reading = Reading(recomputed=layout.recomputed)
    for reader in readers:
        cache = reader.cache(batch)
        end = batch.width - 1 if limit is None else min(batch.width - 1, cache.length + limit)
        if end > cache.length:
            reading.tokens[reader.is_draft] = batch.size * (end - cache.length)  # before the read moves the cache on
            started = time.perf_counter()
            runner.read(reader.model, batch, cache, batch.tokens[:, cache.length : end])
            runner.wait()
            reading.seconds[reader.is_draft] = time.perf_counter() - started
    _locate(batch, draft_read=any(reader.is_draft for reader in readers))
    return reading


def _locate(batch: BatchState, *, draft_read: bool) -> None:
    """Record where each row's tokens and KV now are, and how many columns each cache holds for it."""
    pads = batch.host.pad
    target = [max(0, batch.target_len - pad) for pad in pads]
    draft = [max(0, batch.draft_len - pad) for pad in pads] if draft_read else batch.host.draft_cached
    for i, (row, pad) in enumerate(zip(batch.rows, pads, strict=True)):
        row.kv = KVLocation(batch.slab, i, start=pad, target_cached=target[i], draft_cached=draft[i])


def prompt_logprobs(
    model: torch.nn.Module, runner: ModelRunner, prompt: list[int], top: int, chunk: int = SCORE_CHUNK
) -> list[TokenLogprob]:
    """The model's logprob of each prompt token after the first, given the tokens before it, with its ``top``
    most probable alternatives there (:func:`~batchspec.engine.logprobs.scored`): ``len(prompt) - 1`` entries.

    The prompt is read on its own, in a cache of its own, ``chunk`` columns per forward. With the int8 forward the
    logits of a position do not depend on the batch or the chunking, so these are the bits of the logprob the same
    token gets when the model generates it after the same tokens.

    Example: prompt ``[5, 9, 2]`` gives the logprobs of 9 after ``[5]`` and of 2 after ``[5, 9]``.
    """
    tokens = torch.tensor([prompt], device=runner.device)  # [1, S]
    cache = BatchKVCache.for_model(model)
    batch = BatchState.dense(tokens, cache)
    out: list[TokenLogprob] = []
    for start in range(0, len(prompt) - 1, chunk):
        end = min(start + chunk, len(prompt) - 1)
        logits = runner.logits(model, batch, cache, tokens[:, start:end], keep=end - start)  # [1, c, V]
        values = scored(logits, tokens[:, start + 1 : end + 1], top)  # [1, c, 1 + 2·top]
        cells = unpacked(values.flatten().tolist(), top, end - start)
        out.extend(TokenLogprob(t, lp, alt) for t, (lp, alt) in zip(prompt[start + 1 : end + 1], cells, strict=True))
    return out
