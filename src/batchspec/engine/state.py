"""Per-row and per-batch state, with the synchronisation invariants made checkable.

Layout: a batch is a left-padded, right-aligned token matrix of width ``L``. Row ``i`` has ``pad[i]`` padding
columns followed by ``content[i]`` real tokens (its prompt, then what it generated).

- (I1) rectangular alignment: ``pad[i] + content[i] == L`` for every row.
- (I2) position ids: ``pos[i, j] = max(0, #real tokens in columns 0..j of row i - 1) = max(0, j - pad[i])``.

Padding is known only from ``pad``; the value written into padding columns is a filler and is never compared
against, so prompts may contain the pad or EOS id as real tokens.

The last real token of every row sits in column ``L - 1``. It is *pending*: no KV exists for it yet, and it
is the first input of the next verification. Between rounds a row remembers where its KV is
(:class:`KVLocation`): the :class:`~batchspec.engine.kv_cache.Slab` of the batch it last ran in, its row there, the
column its tokens start at, and how many columns from there each model's cache holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from batchspec.config import SamplingParams, require_int
from batchspec.engine.acceptance import RowAcceptance
from batchspec.engine.errors import InvariantError
from batchspec.engine.kv_cache import Slab
from batchspec.engine.logprobs import MAX_TOP, TokenLogprob
from batchspec.engine.penalties import Penalties
from batchspec.engine.retokenize import DraftText

if TYPE_CHECKING:
    from batchspec.engine.grammar import Grammar, GrammarState
    from batchspec.engine.lookup import NgramIndex

FINISH_EOS = "eos"
FINISH_LENGTH = "length"


@dataclass
class KVLocation:
    """Where a row's tokens and KV live between rounds.

    Attributes:
        slab: the storage of the batch the row last ran in.
        row: the row's index in ``slab``.
        start: the slab column of the row's first real token.
        target_cached: target KV columns valid from ``start`` (``content - 1`` after a round).
        draft_cached: draft KV columns valid from ``start`` (the draft may lag; it re-reads what it lacks).
    """

    slab: Slab
    row: int
    start: int
    target_cached: int
    draft_cached: int


def check_budget(max_new_tokens: object) -> None:
    """Raise ValueError unless ``max_new_tokens`` is a budget of new tokens: an integer >= 0."""
    require_int("max_new_tokens", max_new_tokens, minimum=0)


@dataclass
class Sequence:
    """One prompt's life: its tokens, its budget, how it samples, why it stopped and where its KV is.

    ``sampling`` and ``row_seed`` (derived from its request's seed) fix the row's tokens: with temperature > 0 the
    token at output position ``n`` is a function of the prefix, ``row_seed`` and ``n`` (see
    :mod:`batchspec.engine.sampling`). Rows decoded in one round may each sample differently. ``lookup`` (its
    prompt-lookup index) and ``acceptance`` (its recent acceptance of drafts) are kept by the proposers and the
    draft-length planner, and ``draft_text`` (its text in a draft's own tokens) by a draft of another tokenizer.
    ``max_new_tokens`` is the row's budget of new tokens (an integer >= 0, checked on
    construction), the one the engine reads.

    ``prefix_namespace`` is who may share the row's prompt prefix through the prefix cache
    (:mod:`batchspec.engine.prefix_cache`), and ``cached_tokens`` how many prompt tokens it reused from there.

    ``reading`` (None once its prompt is read): while the row's prompt is read inside the rounds of the rows that
    decode (:mod:`batchspec.engine.riding`), the prompt tokens laid out so far; its content is then
    ``prompt[:reading]``, the last of them pending, and it generates nothing.

    ``penalties`` and ``grammar`` shape the target's distribution (:mod:`batchspec.engine.shaping`); with
    ``logprobs`` set (the number of top alternatives, 0 for the chosen token's only) every output token gets its
    :class:`~batchspec.engine.logprobs.TokenLogprob` in ``token_logprobs``; with ``prompt_logprobs`` set, so does
    every prompt token after the first, in ``prompt_token_logprobs`` (filled before the row's prompt is read).
    """

    index: int
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    row_seed: int = 0
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    kv: KVLocation | None = None
    lookup: NgramIndex | None = field(default=None, repr=False)
    draft_text: DraftText | None = field(default=None, repr=False)
    acceptance: RowAcceptance = field(default_factory=RowAcceptance, repr=False)
    penalties: Penalties = field(default_factory=Penalties)
    grammar: Grammar | None = None
    logprobs: int | None = None
    token_logprobs: list[TokenLogprob] = field(default_factory=list, repr=False)
    prompt_logprobs: int | None = None
    prompt_token_logprobs: list[TokenLogprob] | None = field(default=None, repr=False)
    prefix_namespace: str = ""
    cached_tokens: int = 0
    reading: int | None = None
    _grammar_state: GrammarState | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        check_budget(self.max_new_tokens)
        if self.logprobs is not None:
            require_int("logprobs", self.logprobs, minimum=0, maximum=MAX_TOP)
        if self.prompt_logprobs is not None:
            require_int("prompt_logprobs", self.prompt_logprobs, minimum=0, maximum=MAX_TOP)

    def grammar_state(self) -> GrammarState:
        """The row's grammar matcher, started on first use and advanced past the output so far."""
        if self.grammar is None:
            raise InvariantError(f"row {self.index} has no grammar")
        if self._grammar_state is None:
            self._grammar_state = self.grammar.start()
            if self.output:
                self._grammar_state.advance(self.output)
        return self._grammar_state

    @property
    def content_len(self) -> int:
        return len(self.prompt) + len(self.output) if self.reading is None else self.reading

    @property
    def content(self) -> list[int]:
        """The tokens laid out in the row's batch: its prompt and output, or the prompt's first ``reading``."""
        return self.prompt + self.output if self.reading is None else self.prompt[: self.reading]

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.output)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def ready(self) -> bool:
        """The target's KV covers every real token but the pending one: the row can join a round (its prompt is
        read, or it is read inside the rounds; a prompt of one token needs no reading)."""
        return (0 if self.kv is None else self.kv.target_cached) == self.content_len - 1

    def read_on(self, columns: int) -> None:
        """``columns`` more prompt tokens were read inside a round: the row's pending token moves on by as many, and
        once it is the prompt's last the row decodes like any other."""
        if self.reading is None or not 0 < columns <= len(self.prompt) - self.reading:
            raise InvariantError(f"row {self.index} cannot read {columns} more prompt tokens")
        self.reading += columns
        if self.reading == len(self.prompt):
            self.reading = None

    def append(self, tokens: list[int], eos_token_ids: frozenset[int]) -> int:
        """Append accepted tokens, stopping after the first EOS or at the budget.

        Returns how many of ``tokens`` were kept; the rest (past EOS or budget) are dropped.
        """
        kept = tokens[: self.remaining]
        for j, token in enumerate(kept):
            if token in eos_token_ids:
                kept = kept[: j + 1]
                self.finish_reason = FINISH_EOS
                break
        self.output.extend(kept)
        if self.finish_reason is None and self.remaining == 0:
            self.finish_reason = FINISH_LENGTH
        if self.finished:
            self.kv, self.draft_text = None, None
        return len(kept)

    def retire(self, reason: str) -> None:
        """Finish now, before EOS or budget (a stop string was met, the client left, the round failed), and
        release the KV (and a draft of another tokenizer's, :attr:`draft_text`); the storage is freed once no row
        references it."""
        self.finish_reason = reason
        self.kv, self.draft_text = None, None

    def check_location(self) -> None:
        """Raise :class:`~batchspec.engine.errors.InvariantError` unless the row's KV location matches its tokens and
        the caches. A row whose prompt is still being read in chunks (no output yet) may hold fewer target columns
        than a ready row."""
        kv = self.kv
        if kv is None:
            raise InvariantError(f"row {self.index} has no KV location")
        if not (0 <= kv.row < kv.slab.size):
            raise InvariantError(f"row {self.index}: slab row {kv.row} out of range")
        if self.output and kv.target_cached != self.content_len - 1:
            raise InvariantError(f"row {self.index}: target KV misses columns")
        if not (0 <= kv.target_cached <= self.content_len - 1):
            raise InvariantError(f"row {self.index}: target KV covers {kv.target_cached}")
        if not (0 <= kv.draft_cached <= self.content_len - 1):
            raise InvariantError(f"row {self.index}: draft KV covers {kv.draft_cached}")
        stored = kv.slab.tokens[kv.row, kv.start : kv.start + self.content_len].tolist()
        if stored != self.content:
            raise InvariantError(f"row {self.index}: stored tokens out of sync")
        # a row whose first chunk ended before its first token holds no target KV yet
        if kv.target_cached and kv.slab.target.length < kv.start + kv.target_cached:
            raise InvariantError(f"row {self.index}: target KV too short")
        if kv.slab.draft is not None and kv.draft_cached and kv.slab.draft.length < kv.start + kv.draft_cached:
            raise InvariantError(f"row {self.index}: draft KV too short")


@dataclass(frozen=True)
class HostColumns:
    """What the host knows of a batch's layout, as lists (the device tensors of :class:`BatchState` hold the same
    numbers): reading them needs no device→host copy.

    Attributes:
        pad, content, draft_cached: per row, as in :class:`BatchState`.
    """

    pad: list[int]
    content: list[int]
    draft_cached: list[int]


@dataclass(frozen=True)
class Moved:
    """What a realignment copied of the KV caches: ``bytes`` over both models, and the ``rows`` whose target KV moved
    (a row that stays where it is costs nothing; one copied into fresh storage counts, whether it shifted or not)."""

    bytes: int
    rows: int

    def __add__(self, other: Moved) -> Moved:
        return Moved(self.bytes + other.bytes, self.rows + other.rows)


@dataclass
class BatchState:
    """The rows decoded together in one round, laid out in ``slab``.

    Attributes:
        rows: the sequences, in batch order.
        pad: ``[B]`` padding length of each row.
        content: ``[B]`` number of real tokens of each row.
        slab: tokens ``[B, L]`` and the caches; the target cache holds ``target_len <= L - 1`` columns and the
            draft cache ``draft_len <= L - 1``: a forward feeds the columns its cache lacks.
        draft_cached: ``[B]`` draft KV columns valid from each row's first real token. Rows in step with the
            batch have ``draft_len - pad``; a row whose draft lags further (it joined while the draft was idle)
            has fewer, and is caught up before the draft runs again (see :mod:`batchspec.engine.prefill`).
        host: ``pad``, ``content`` and ``draft_cached`` as host lists.
        moved: what laying the rows out copied (see :class:`Moved`).
    """

    rows: list[Sequence]
    pad: torch.Tensor  # [B]
    content: torch.Tensor  # [B]
    slab: Slab
    draft_cached: torch.Tensor  # [B]
    host: HostColumns
    moved: Moved = Moved(0, 0)

    @classmethod
    def dense(cls, tokens: torch.Tensor, cache) -> BatchState:
        """A batch of ``tokens`` ``[B, L]`` with no padding and no rows to track, fed into ``cache``: what timing
        a model's forward needs."""
        size, width = tokens.shape
        zeros = torch.zeros(size, dtype=torch.long, device=tokens.device)  # [B]
        host = HostColumns(pad=[0] * size, content=[width] * size, draft_cached=[0] * size)
        return cls([], zeros, zeros + width, Slab(tokens, cache, None), zeros, host)

    @property
    def size(self) -> int:
        return self.pad.shape[0]

    @property
    def tokens(self) -> torch.Tensor:  # [B, L]
        return self.slab.tokens

    @property
    def width(self) -> int:
        return self.slab.tokens.shape[1]

    @property
    def target_len(self) -> int:
        return self.slab.target.length

    @property
    def draft_len(self) -> int:
        return 0 if self.slab.draft is None else self.slab.draft.length

    @property
    def device(self) -> torch.device:
        return self.pad.device

    def attention_mask(self, width: int) -> torch.Tensor:
        """``[B, width]`` mask over columns ``0 .. width-1``: real tokens and any drafted columns are 1."""
        cols = torch.arange(width, device=self.device)
        return (cols[None, :] >= self.pad[:, None]).long()

    def position_ids(self, start: int, end: int) -> torch.Tensor:
        """``[B, end - start]`` position ids of columns ``start .. end-1`` by invariant I2."""
        return position_ids(torch.arange(start, end, device=self.device), self.pad)

    def check(self) -> None:
        """Raise :class:`~batchspec.engine.errors.InvariantError` unless I1, I2, every row's token stream and the cache
        lengths agree."""
        width = self.width
        if self.tokens.shape != (self.size, width):
            raise InvariantError("tokens shape does not match the rows")
        if self.pad.tolist() != self.host.pad:
            raise InvariantError(f"pad {self.pad.tolist()} differs from the host's {self.host.pad}")
        if self.content.tolist() != self.host.content:
            raise InvariantError("content differs from the host's")
        if self.draft_cached.tolist() != self.host.draft_cached:
            raise InvariantError("draft_cached differs from the host's")
        if not bool((self.pad >= 0).all()):
            raise InvariantError(f"negative padding: {self.pad.tolist()}")
        if not bool((self.pad + self.content == width).all()):
            raise InvariantError(f"I1 broken: pad {self.pad.tolist()} + content {self.content.tolist()} != {width}")
        from_mask = (self.attention_mask(width).cumsum(dim=1) - 1).clamp(min=0)
        if not torch.equal(self.position_ids(0, width), from_mask):
            raise InvariantError("I2 broken: position ids != mask cumsum - 1")
        for i, row in enumerate(self.rows):
            if int(self.content[i]) != row.content_len:
                raise InvariantError(f"row {row.index}: content length out of sync")
            real = self.tokens[i, int(self.pad[i]) :].tolist()
            if real != row.content:
                raise InvariantError(f"row {row.index}: token stream out of sync")
        if not (0 <= self.target_len <= width - 1):
            raise InvariantError(f"target KV covers {self.target_len} of {width - 1} columns")
        if not (0 <= self.draft_len <= width - 1):
            raise InvariantError(f"draft KV covers {self.draft_len} of {width - 1} columns")
        in_cache = (self.draft_len - self.pad).clamp(min=0)  # [B]
        if not bool((self.draft_cached >= 0).all() and (self.draft_cached <= in_cache).all()):
            raise InvariantError(
                f"draft KV of rows {self.draft_cached.tolist()} beyond the cache's {self.draft_len} columns"
            )


def position_ids(columns: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    """``[B, q]`` position ids of the columns ``columns`` ``[q]`` of rows padded by ``pad`` ``[B]`` (I2)."""
    return (columns[None, :] - pad[:, None]).clamp(min=0)


def visible_keys(queries: torch.Tensor, pad: torch.Tensor, width: int, window: int | None = None) -> torch.Tensor:
    """``[B, 1, q, width]`` (bool): which key columns ``0 .. width-1`` the queries at columns ``queries`` ``[q]`` of
    rows padded by ``pad`` ``[B]`` see: the row's own columns up to the query's (I1; :mod:`batchspec.engine.runner` has
    a worked example), and with a sliding ``window`` only the last ``window`` of them (a row's columns are its
    positions in order, so a distance in columns is one in positions)."""
    keys = torch.arange(width, device=pad.device)  # [width]
    causal = keys[None, :] <= queries[:, None]  # [q, width]
    if window is not None:
        causal &= keys[None, :] > queries[:, None] - window
    return (causal[None, :, :] & (keys[None, None, :] >= pad[:, None, None]))[:, None]  # [B, 1, q, width]
