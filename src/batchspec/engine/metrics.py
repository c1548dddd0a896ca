"""One stats object per run: token counts, acceptance and where the time went."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field

import torch

STAGES = ("prefill", "draft", "verify", "realign", "other")


@dataclass
class GenerationStats:
    """Counters filled by every method.

    Terms: a *round* is one realign → propose → verify → accept step of one batch; a *row-round* is one row's
    part in a round. ``accepted_length_histogram[a]`` counts row-rounds that accepted ``a`` draft tokens
    (the bonus token is not counted in ``a``). Seconds are split into prefill (reading new prompts, and a lagging
    draft's catch-up), draft, verify, realign and other (bookkeeping: accepting tokens, retiring rows, choosing
    batches); their sum is close to ``wall_s``.

    Layout terms: a *realignment* is a round whose rows have different lengths, so the batch is padded and rows
    shift (unpad–append–repad); a *grouped* round has rows of one length and needs none. A *cache gather* is a
    round whose tokens and KV were copied into fresh storage (rows joined, left or shifted); a round in
    lockstep reuses the previous round's storage and copies nothing. ``gather_s`` is the part of ``realign_s``
    spent copying into fresh storage. ``realign_bytes`` counts the KV bytes realignments copied (both models; a
    row that stays where it is copies none) and ``realign_rows`` the rows whose target KV they copied.
    ``rows_per_round_histogram[b]`` counts rounds of ``b`` rows.

    ``recomputed_columns`` counts target KV columns that rows already held and were fed again (a batch forward
    starts at the column its least-read row needs); the engine reads prompts apart so that it stays 0.
    ``prefill_chunks`` counts prompt readings (one per group of similar-length prompts read whole, several per
    prompt read in chunks), ``riding_columns`` the prompt columns read inside the rounds of decoding rows instead
    (:mod:`batchspec.engine.riding`; their time is in ``verify_s``). ``prefix_hits`` counts rows that took a cached
    prompt prefix (:mod:`batchspec.engine.prefix_cache`) and ``cached_tokens`` the prompt tokens they did not read.
    """

    generated_tokens: int = 0
    rounds: int = 0
    row_rounds: int = 0
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    ragged_rounds: int = 0
    realignments: int = 0
    cache_gathers: int = 0
    realign_bytes: int = 0
    realign_rows: int = 0
    recomputed_columns: int = 0
    prefill_chunks: int = 0
    riding_columns: int = 0
    prefix_hits: int = 0
    cached_tokens: int = 0
    accepted_length_histogram: dict[int, int] = field(default_factory=dict)
    rows_per_round_histogram: dict[int, int] = field(default_factory=dict)
    wall_s: float = 0.0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    realign_s: float = 0.0
    other_s: float = 0.0
    gather_s: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        """Share of proposed draft tokens that the target accepted (0 when nothing was proposed)."""
        return self.draft_tokens_accepted / self.draft_tokens_proposed if self.draft_tokens_proposed else 0.0

    @property
    def mean_tokens_per_row_round(self) -> float:
        """New tokens a row gains per round: accepted drafts plus the bonus token, averaged."""
        return self.generated_tokens / self.row_rounds if self.row_rounds else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Alias of ``mean_tokens_per_row_round`` in the speculative-decoding literature's terms."""
        return self.mean_tokens_per_row_round

    @property
    def grouping_rate(self) -> float:
        """Share of rounds formed without any realignment (rows of one length, no padding)."""
        return 1.0 - self.realignments / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def record_layout(self, *, size: int, padded: bool, copied: bool, recomputed: int, moved_bytes: int,
                      moved_rows: int) -> None:
        """Account how a round's batch of ``size`` rows was formed (``moved_bytes`` of KV copied, of
        ``moved_rows`` rows)."""
        self.realignments += int(padded)
        self.cache_gathers += int(copied)
        self.realign_bytes += moved_bytes
        self.realign_rows += moved_rows
        self.recomputed_columns += recomputed
        self.rows_per_round_histogram[size] = self.rows_per_round_histogram.get(size, 0) + 1

    def record_round(self, accepted: list[int], proposed: list[int]) -> None:
        """Account one round: row ``i`` accepted ``accepted[i]`` of the ``proposed[i]`` drafts it proposed."""
        self.rounds += 1
        self.row_rounds += len(accepted)
        self.draft_tokens_proposed += sum(proposed)
        self.draft_tokens_accepted += sum(accepted)
        drafting = [a for a, n in zip(accepted, proposed, strict=True) if n]
        if len(set(drafting)) > 1:
            self.ragged_rounds += 1
        for length, count in Counter(drafting).items():
            self.accepted_length_histogram[length] = self.accepted_length_histogram.get(length, 0) + count

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready view, derived rates included."""
        out: dict[str, object] = {k: v for k, v in self.__dict__.items() if not k.startswith("_")}
        for name in ("accepted_length_histogram", "rows_per_round_histogram"):
            out[name] = {str(k): v for k, v in sorted(getattr(self, name).items())}
        out["grouping_rate"] = self.grouping_rate
        out["acceptance_rate"] = self.acceptance_rate
        out["mean_tokens_per_row_round"] = self.mean_tokens_per_row_round
        out["tokens_per_s"] = self.tokens_per_s
        return out


class StageTimer:
    """Adds elapsed seconds to a stage of a :class:`GenerationStats`.

    With ``enabled=False`` stages cost nothing and stay at zero, except ``other`` which is then the whole wall
    time. On the CPU a stage is timed with the wall clock. On CUDA the host runs ahead of the device, so a stage
    edge records a CUDA event instead of waiting for the device; the events are read at the end of the wall span
    (:meth:`wall`), where the device is synchronised once, so timing costs one synchronisation per round.
    """

    def __init__(self, stats: GenerationStats, *, enabled: bool, device: torch.device) -> None:
        self.stats = stats
        self.enabled = enabled
        self._events = enabled and device.type == "cuda"
        self._pending: list[tuple[str, object, object]] = []

    def stage(self, name: str) -> AbstractContextManager[None]:
        """Adds the seconds of a ``with`` block to stage ``name`` (one of :data:`STAGES`)."""
        return self._adding(f"{name}_s", self.enabled)

    def gathering(self, *, active: bool) -> AbstractContextManager[None]:
        """Adds to ``gather_s`` (inside the realign stage; not a stage of its own)."""
        return self._adding("gather_s", self.enabled and active)

    @contextmanager
    def _adding(self, attr: str, timed: bool) -> Iterator[None]:
        """Adds the seconds of a ``with`` block to ``attr`` of the stats when ``timed``."""
        if not timed:
            yield
            return
        start = self._mark()
        try:
            yield
        finally:
            self._add(attr, start, self._mark())

    @contextmanager
    def wall(self) -> Iterator[None]:
        """Times a span of rounds; whatever no stage claimed is booked as ``other``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._resolve()
            self.stats.wall_s += time.perf_counter() - start
            staged = sum(getattr(self.stats, f"{stage}_s") for stage in STAGES)
            self.stats.other_s += max(0.0, self.stats.wall_s - staged)

    def _mark(self) -> object:
        if not self._events:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _add(self, attr: str, start: object, end: object) -> None:
        if self._events:
            self._pending.append((attr, start, end))
        else:
            setattr(self.stats, attr, getattr(self.stats, attr) + end - start)

    def _resolve(self) -> None:
        """Book the recorded CUDA event pairs (one device synchronisation)."""
        if not self._pending:
            return
        self._pending[-1][2].synchronize()
        for attr, start, end in self._pending:
            setattr(self.stats, attr, getattr(self.stats, attr) + start.elapsed_time(end) / 1000)
        self._pending.clear()
