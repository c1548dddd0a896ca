"""Online EqSpec: one running batch of up to ``batch_size`` rows, realigned every round; queued requests join
between rounds as soon as a row is free (their prompts are read apart, see :mod:`batchspec.prefill`)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from batchspec.state import Sequence


@dataclass
class RunningBatch:
    """Every admitted row runs every round; rows leave when they finish and queued rows take their place."""

    batch_size: int
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
