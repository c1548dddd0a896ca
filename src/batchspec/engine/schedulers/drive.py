"""The driver: round after round over the rows a scheduler picks, for offline generation and the server alike.

Offline, every sequence is queued before the first round and the drive ends when the scheduler is empty; the
server's engine thread queues requests as they arrive (``admit``) and keeps driving until it shuts down.
"""

from __future__ import annotations

from typing import Protocol

from batchspec.engine.core import Engine
from batchspec.engine.schedulers import Scheduler
from batchspec.engine.state import Sequence
from batchspec.memory import HeapWatch


class Hooks(Protocol):
    def admit(self, scheduler: Scheduler) -> bool:
        """Before every round: queue new rows, drop retired ones; False ends the drive."""
        ...

    def ran(self, rows: list[Sequence], finished: list[Sequence]) -> None:
        """After a round over ``rows``; ``finished`` have left the scheduler."""
        ...

    def failed(self, rows: list[Sequence], error: Exception) -> None:
        """A round over ``rows`` raised; they are removed from the scheduler afterwards."""
        ...


def drive(engine: Engine, scheduler: Scheduler, hooks: Hooks) -> None:
    """Run rounds until ``hooks.admit`` says stop; each round's time (selection included) is wall time. Whenever the
    last row has finished, the memory the forwards freed is given back; while rows run, the heap keeps at most
    :data:`~batchspec.memory.HELD_FREE_BYTES` of it resident (:class:`~batchspec.memory.HeapWatch`)."""
    heap = HeapWatch()
    while hooks.admit(scheduler):
        with engine.timer.wall():
            rows = scheduler.select()
            if not rows:
                continue
            try:
                engine.step(rows, draining=scheduler.draining)
            except Exception as error:
                hooks.failed(rows, error)
                scheduler.remove(rows)
                continue
            finished = scheduler.ran(rows)
        hooks.ran(rows, finished)
        if finished and scheduler.waiting + scheduler.running == 0:
            heap.reset()  # idle: the forwards' working memory goes back to the system (batchspec.memory)
        else:
            heap.check()


class Offline:
    """Hooks of ``batchspec.generate``: drive while work is left, count finished rows, let errors through."""

    def __init__(self, on_finished) -> None:
        self.on_finished = on_finished

    def admit(self, scheduler: Scheduler) -> bool:
        return scheduler.waiting + scheduler.running > 0

    def ran(self, rows: list[Sequence], finished: list[Sequence]) -> None:
        self.on_finished(len(finished))

    def failed(self, rows: list[Sequence], error: Exception) -> None:
        raise error
