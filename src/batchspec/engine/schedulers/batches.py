"""EqSpec's batches: up to ``batch_size`` rows decoded together, realigned (unpad–append–repad) every round, and a
queue of the rest. A row that finishes leaves the batch at once and the first queued row takes its place before the
next round (its prompt is read apart, see :mod:`batchspec.engine.prefill`), offline and online alike: a row that
speculation ends sooner frees its place for the next prompt, so the tokens it gained are not lost to a batch that
waits for its slowest row.

Offline (``online=False``) every row is queued before the first round, so once the queue is empty no row will take
the place of one that finishes: the batch is *draining*, and ends with its slowest row. Online, a request may
arrive at any time, so the batch never drains.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from batchspec.engine.state import Sequence


@dataclass
class Batches:
    """One batch of at most ``batch_size`` admitted rows and a queue; queued rows join whenever a row is free."""

    batch_size: int
    online: bool = False
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
        """Offline, once nothing waits."""
        return not self.online and not self.queue

    def add(self, row: Sequence) -> None:
        self.queue.append(row)
        self._admit()

    def select(self) -> list[Sequence]:
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
