"""Offline EqSpec: fixed batches of ``batch_size`` prompts in order, each decoded to completion; the batch is
realigned (unpad–append–repad) every round. Rows that finish leave their batch at once."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from batchspec.state import Sequence


@dataclass
class StaticBatches:
    """Consecutive batches of ``batch_size`` queued rows; the next batch starts when the current one is done."""

    batch_size: int
    queue: deque[Sequence] = field(default_factory=deque)
    batch: list[Sequence] = field(default_factory=list)

    @property
    def capacity(self) -> int:
        return self.batch_size

    @property
    def waiting(self) -> int:
        return len(self.queue)

    @property
    def running(self) -> int:
        return len(self.batch)

    def add(self, row: Sequence) -> None:
        self.queue.append(row)

    def select(self) -> list[Sequence]:
        if not self.batch:
            self.batch = [self.queue.popleft() for _ in range(min(self.batch_size, len(self.queue)))]
        return list(self.batch)

    def ran(self, rows: list[Sequence]) -> list[Sequence]:
        done = [row for row in self.batch if row.finished]
        self.batch = [row for row in self.batch if not row.finished]
        return done

    def remove(self, rows: list[Sequence]) -> None:
        gone = {row.index for row in rows}
        self.batch = [row for row in self.batch if row.index not in gone]
        self.queue = deque(row for row in self.queue if row.index not in gone)
