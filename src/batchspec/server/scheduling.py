"""Which admitted requests run together in each round of the server's engine loop.

Requests join between rounds and leave as soon as they finish or are cancelled. A row has no KV before its
first round; that round reads (prefills) its whole prompt.

* :class:`RunningBatch` (EqSpec, and the autoregressive baseline): up to ``B`` rows run every round, realigned
  as they accept different counts. Newcomers are prefilled in a round of their own and join the others in the
  next one, so that a long prompt is read once rather than re-read by every row of the batch.
* :class:`PooledBatches` (ExSpec): a window of ``W`` rows from which every round picks ``B`` rows of one length
  when it can (:class:`~batchspec.schedulers.exspec.SequencePool`), falling back to realignment.

The rows of one round must share their sampling settings (temperature, top-k, top-p; seeds may differ), so
:class:`SamplingGroups` keeps one such scheduler per distinct setting and gives the groups rounds in turn. With
every request greedy (or all alike) there is one group and nothing changes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from batchspec.config import SpecConfig
from batchspec.sampling import SamplingParams
from batchspec.schedulers.exspec import SequencePool
from batchspec.state import Sequence


class ServingScheduler(Protocol):
    """The rows of the engine loop: admitted, unfinished sequences."""

    @property
    def capacity(self) -> int:
        """Rows that may be admitted at once."""
        ...

    @property
    def active(self) -> list[Sequence]: ...

    def add(self, row: Sequence) -> None:
        """Admit ``row`` (only while ``len(active) < capacity``)."""
        ...

    def select(self) -> list[Sequence]:
        """The rows of the next round; at least one whenever ``active`` is not empty."""
        ...

    def ran(self, rows: list[Sequence]) -> None:
        """Account a round over ``rows``; finished rows leave."""
        ...

    def remove(self, rows: list[Sequence]) -> None:
        """Drop ``rows`` (retired early) between rounds."""
        ...


@dataclass
class RunningBatch:
    """EqSpec serving: one batch of up to ``batch_size`` rows; newcomers get a prefill round of their own."""

    batch_size: int
    rows: list[Sequence] = field(default_factory=list)

    @property
    def capacity(self) -> int:
        return self.batch_size

    @property
    def active(self) -> list[Sequence]:
        return list(self.rows)

    def add(self, row: Sequence) -> None:
        self.rows.append(row)

    def select(self) -> list[Sequence]:
        fresh = [row for row in self.rows if row.kv is None]
        return fresh or list(self.rows)

    def ran(self, rows: list[Sequence]) -> None:
        self.rows = [row for row in self.rows if not row.finished]

    def remove(self, rows: list[Sequence]) -> None:
        gone = {row.index for row in rows}
        self.rows = [row for row in self.rows if row.index not in gone]


@dataclass
class PooledBatches:
    """ExSpec serving: a window of rows regrouped by length every round."""

    batch_size: int
    pool: SequencePool

    @property
    def capacity(self) -> int:
        return self.pool.capacity

    @property
    def active(self) -> list[Sequence]:
        return list(self.pool.window)

    def add(self, row: Sequence) -> None:
        self.pool.add(row)
        self.pool.refill()

    def select(self) -> list[Sequence]:
        return self.pool.select(self.batch_size) if self.pool.window else []

    def ran(self, rows: list[Sequence]) -> None:
        self.pool.ran(rows)

    def remove(self, rows: list[Sequence]) -> None:
        self.pool.discard(rows)


@dataclass
class SamplingGroups:
    """One scheduler per distinct sampling setting, sharing ``capacity`` rows; groups take rounds in turn."""

    capacity: int
    make: Callable[[], ServingScheduler]
    groups: dict[SamplingParams, ServingScheduler] = field(default_factory=dict)
    turns: deque[SamplingParams] = field(default_factory=deque)

    @property
    def active(self) -> list[Sequence]:
        return [row for group in self.groups.values() for row in group.active]

    def add(self, row: Sequence) -> None:
        if row.sampling not in self.groups:
            self.groups[row.sampling] = self.make()
            self.turns.append(row.sampling)
        self.groups[row.sampling].add(row)

    def select(self) -> list[Sequence]:
        if not self.turns:
            return []
        key = self.turns[0]
        self.turns.rotate(-1)
        return self.groups[key].select()

    def ran(self, rows: list[Sequence]) -> None:
        if rows:
            self.groups[rows[0].sampling].ran(rows)
        self._drop_empty()

    def remove(self, rows: list[Sequence]) -> None:
        for key in {row.sampling for row in rows}:
            if key in self.groups:
                self.groups[key].remove([row for row in rows if row.sampling == key])
        self._drop_empty()

    def _drop_empty(self) -> None:
        for key in [key for key, group in self.groups.items() if not group.active]:
            del self.groups[key]
            self.turns.remove(key)


def make_scheduler(config: SpecConfig) -> ServingScheduler:
    """The serving scheduler of ``config.method``, grouping rows by their sampling settings."""
    if config.method == "exspec":
        return SamplingGroups(
            config.window,
            lambda: PooledBatches(config.batch_size, SequencePool(waiting=deque(), capacity=config.window)),
        )
    return SamplingGroups(config.batch_size, lambda: RunningBatch(config.batch_size))
