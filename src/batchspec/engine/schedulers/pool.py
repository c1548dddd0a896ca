"""ExSpec: cross-batch scheduling over a pool of sequences, offline and online.

Every prompt is a :class:`~batchspec.engine.state.Sequence` that carries its own tokens and the location of its KV.
A sliding window of ``W >= B`` sequences is active at once and is refilled from the pool (in order of prompt
length with ``sort_by_length``) as sequences finish; finished sequences leave at once. Each round:

1. **Group.** The window's rows are bucketed by length (and by whether their prompt is read yet). A bucket of at
   least ``B`` rows — or one holding every row left in the window — gives a *grouped* round of ``B`` rows of
   one length: no padding, no realignment. When the ``B`` rows of one previous batch are all in the bucket
   they are taken as they are, so a group that stays in lockstep keeps its storage and copies nothing.
2. **Fall back.** Otherwise the batch is the ``B`` rows closest in length to the row that has waited longest,
   padded and realigned as in EqSpec. Realignment is lazy: only these rows move, only now.
3. **No starvation.** A row that has sat out ``patience = 2 * ceil(W / B)`` rounds is served in the next round,
   grouped or not.

Rows that run together are gathered once into one storage and stay there while they keep running together;
see :mod:`batchspec.engine.realign`. Storage that the window's rows fill to at most half is compacted after each round,
so the KV kept alive stays within about twice what the window's rows need.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from batchspec.engine.errors import InvariantError
from batchspec.engine.realign import compact
from batchspec.engine.state import Sequence


@dataclass
class SequencePool:
    """The sequences of one run: waiting to enter the window, active in it, or done.

    Attributes:
        waiting: not yet admitted, in admission order.
        window: active (admitted, unfinished) sequences.
        capacity: the window size W.
        waited: rounds each window row has sat out since it last ran, by sequence index.
        done: sequences finished so far.
    """

    waiting: deque[Sequence]
    capacity: int
    window: list[Sequence] = field(default_factory=list)
    waited: dict[int, int] = field(default_factory=dict)
    done: int = 0

    def refill(self) -> None:
        """Admit waiting sequences until the window is full or the pool is empty."""
        while len(self.window) < self.capacity and self.waiting:
            row = self.waiting.popleft()
            self.window.append(row)
            self.waited[row.index] = 0

    def add(self, row: Sequence) -> None:
        """Queue a sequence; ``refill`` admits it."""
        self.waiting.append(row)

    def discard(self, rows: list[Sequence]) -> None:
        """Take ``rows`` out of the pool wherever they are (retired early: cancelled or failed); they count as
        done. Call between rounds."""
        gone = {row.index for row in rows}
        kept_window = [row for row in self.window if row.index not in gone]
        kept_waiting = deque(row for row in self.waiting if row.index not in gone)
        self.done += len(self.window) - len(kept_window) + len(self.waiting) - len(kept_waiting)
        for index in gone:
            self.waited.pop(index, None)
        self.window, self.waiting = kept_window, kept_waiting

    def select(self, batch_size: int) -> list[Sequence]:
        """The rows of the next round (see the module docstring for the policy)."""
        patience = 2 * math.ceil(self.capacity / batch_size)
        starving = max(self.window, key=lambda row: self.waited[row.index])
        if self.waited[starving.index] < patience:
            bucket = self._largest_bucket()
            if len(bucket) >= min(batch_size, len(self.window)):
                return _in_slab_order(self._pick_from_bucket(bucket, batch_size))
        return _in_slab_order(self._nearest(starving, batch_size))

    def ran(self, rows: list[Sequence]) -> int:
        """Account a round over ``rows``; retire finished rows and compact the storage the window no longer
        fills (see :func:`batchspec.engine.realign.compact`). Returns how many finished."""
        ran = {row.index for row in rows}
        for row in self.window:
            self.waited[row.index] = 0 if row.index in ran else self.waited[row.index] + 1
        finished = [row for row in self.window if row.finished]
        for row in finished:
            del self.waited[row.index]
        self.window = [row for row in self.window if not row.finished]
        self.done += len(finished)
        compact(self.window)
        return len(finished)

    def _largest_bucket(self) -> list[Sequence]:
        buckets: dict[tuple[int, bool], list[Sequence]] = {}
        for row in self.window:
            buckets.setdefault((row.content_len, row.ready), []).append(row)
        return max(buckets.values(), key=lambda rows: (len(rows), max(self.waited[r.index] for r in rows)))

    def _pick_from_bucket(self, bucket: list[Sequence], batch_size: int) -> list[Sequence]:
        """``batch_size`` rows of one bucket: a whole previous batch in lockstep if there is one, else the rows
        that have waited longest."""
        by_slab: dict[int, list[Sequence]] = {}
        for row in bucket:
            if row.kv is not None:
                by_slab.setdefault(id(row.kv.slab), []).append(row)
        for rows in by_slab.values():
            if len(rows) == rows[0].kv.slab.size == min(batch_size, len(bucket)):
                return rows
        return sorted(bucket, key=lambda row: -self.waited[row.index])[:batch_size]

    def _nearest(self, anchor: Sequence, batch_size: int) -> list[Sequence]:
        """``anchor`` and the rows closest to it in length (same KV state first), for a padded batch."""

        def distance(row: Sequence) -> tuple[bool, int, int]:
            same_state = row.ready == anchor.ready
            return (not same_state, abs(row.content_len - anchor.content_len), -self.waited[row.index])

        return sorted(self.window, key=distance)[:batch_size]

    def check(self, total: int) -> None:
        """Raise :class:`~batchspec.engine.errors.InvariantError` unless the pool is consistent: every sequence in
        exactly one place."""
        if len(self.window) > self.capacity:
            raise InvariantError(f"window holds {len(self.window)} > W = {self.capacity}")
        if self.done + len(self.window) + len(self.waiting) != total:
            raise InvariantError("a sequence was lost or duplicated")
        if len({row.index for row in self.window}) != len(self.window):
            raise InvariantError("a sequence is in the window twice")
        if set(self.waited) != {row.index for row in self.window}:
            raise InvariantError("waiting counters out of sync")
        if self.window and self.waiting and len(self.window) != self.capacity:
            raise InvariantError("window not refilled")
        for row in self.waiting:
            if row.output or row.kv is not None:
                raise InvariantError(f"row {row.index} ran before it was admitted")
        locations = set()
        for row in self.window:
            if row.finished:
                raise InvariantError(f"finished row {row.index} is still in the window")
            if row.kv is not None:
                row.check_location()
                locations.add((id(row.kv.slab), row.kv.row))
        if len(locations) != sum(row.kv is not None for row in self.window):
            raise InvariantError("two rows share one KV row")


def _in_slab_order(rows: list[Sequence]) -> list[Sequence]:
    """Rows ordered by storage and by row within it (so that a whole previous batch keeps its layout), then
    the rows without KV; deterministic: storages rank by their lowest sequence index."""
    rank: dict[int, int] = {}
    for row in sorted(rows, key=lambda r: r.index):
        if row.kv is not None:
            rank.setdefault(id(row.kv.slab), len(rank))
    return sorted(rows, key=lambda r: (0, rank[id(r.kv.slab)], r.kv.row) if r.kv else (1, r.index, 0))


@dataclass
class PooledWindow:
    """ExSpec behind the scheduler protocol: a :class:`SequencePool` picking ``batch_size`` rows per round.

    With ``sort_by_length`` (offline) the rows queued before the first round enter the window shortest first; rows
    queued later (online) enter in arrival order. ``check`` verifies the pool after every round (tests).
    """

    batch_size: int
    window: int
    sort_by_length: bool
    check: bool = False
    pool: SequencePool = field(init=False)
    added: int = 0

    def __post_init__(self) -> None:
        self.pool = SequencePool(waiting=deque(), capacity=self.window)

    @property
    def capacity(self) -> int:
        return self.pool.capacity

    @property
    def waiting(self) -> int:
        return len(self.pool.waiting)

    @property
    def running(self) -> int:
        return len(self.pool.window)

    @property
    def draining(self) -> bool:
        """Offline, once nothing waits and the window is one round's rows."""
        return self.sort_by_length and not self.pool.waiting and len(self.pool.window) <= self.batch_size

    def add(self, row: Sequence) -> None:
        self.pool.add(row)
        self.added += 1
        if not self.sort_by_length:
            self.pool.refill()

    def select(self) -> list[Sequence]:
        if self.sort_by_length and not self.pool.window:
            self.pool.waiting = deque(sorted(self.pool.waiting, key=lambda s: (len(s.prompt), s.index)))
        self.pool.refill()
        return self.pool.select(self.batch_size) if self.pool.window else []

    def ran(self, rows: list[Sequence]) -> list[Sequence]:
        finished = [row for row in self.pool.window if row.finished]
        self.pool.ran(rows)
        if self.check:
            self.pool.refill()
            self.pool.check(self.added)
        return finished

    def remove(self, rows: list[Sequence]) -> None:
        self.pool.discard(rows)
