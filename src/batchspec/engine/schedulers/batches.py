"""EqSpec's batches: up to ``batch_size`` rows decoded together, realigned (unpad–append–repad) every round, and a
queue of the rest. Rows that finish leave the batch at once; when queued rows take their place is the one thing
the offline and the online policy do differently (``refill``).

Offline (``refill=False``): fixed batches of ``batch_size`` prompts in order, each decoded to completion before
the next one starts. Online (``refill=True``): one running batch that queued requests join between rounds as soon
as a row is free (their prompts are read apart, see :mod:`batchspec.engine.prefill`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from batchspec.engine.state import Sequence


@dataclass
class Batches:
    """One batch of at most ``batch_size`` admitted rows and a queue; with ``refill`` queued rows join whenever a row
    is free, else only once the whole batch is done."""

    batch_size: int
    refill: bool = False
    queue: deque[Sequence] = field(default_factory=deque)
    rows: list[Sequence] = field(default_factory=list)

    @property
    def capacity(self) -> int:
        return self.batch_size

    @property
    def waiting(self) -> int:
        return len(self.queue)

    @property
    def running(self) -> int:
        return len(self.rows)

    @property
    def draining(self) -> bool:
        return not self.refill

    def add(self, row: Sequence) -> None:
        self.queue.append(row)
        if self.refill:
            self._admit()

    def select(self) -> list[Sequence]:
        if self.refill or not self.rows:
            self._admit()
        return list(self.rows)

    def _admit(self) -> None:
        while self.queue and len(self.rows) < self.batch_size:
            self.rows.append(self.queue.popleft())

    def ran(self, rows: list[Sequence]) -> list[Sequence]:
        done = [row for row in self.rows if row.finished]
        self.rows = [row for row in self.rows if not row.finished]
        return done

    def remove(self, rows: list[Sequence]) -> None:
        gone = {row.index for row in rows}
        self.rows = [row for row in self.rows if row.index not in gone]
        self.queue = deque(row for row in self.queue if row.index not in gone)
