"""Schedulers decide which sequences are decoded together in every round; one driver runs them all.

Every policy has the same five parts (:class:`Scheduler`): ``add`` queues a sequence, ``select`` admits what fits
and names the rows of the next round, ``ran`` accounts a round and lets finished rows leave, ``remove`` drops
rows retired early, and ``capacity`` says how many rows may be admitted at once. :func:`drive` runs rounds over
any of them, for ``batchspec.generate`` (every request queued at the start) and for the server's engine thread
(requests queued as they arrive) alike.

* :class:`~batchspec.engine.schedulers.batches.Batches` — EqSpec (and the autoregressive baseline): one batch of up to
  ``B`` rows, refilled in order as rows leave;
* :class:`~batchspec.engine.schedulers.pool.PooledWindow` — ExSpec, offline and online: a window of ``W`` rows from
  which every round takes ``B`` of one length when it can.
"""

from __future__ import annotations

from typing import Protocol

from batchspec.config import Method, SpecConfig
from batchspec.engine.state import Sequence


class Scheduler(Protocol):
    @property
    def capacity(self) -> int:
        """Rows that may be admitted (decoding) at once."""
        ...

    @property
    def waiting(self) -> int:
        """Queued rows not yet admitted."""
        ...

    @property
    def running(self) -> int:
        """Admitted, unfinished rows."""
        ...

    @property
    def draining(self) -> bool:
        """No row will take the place of one that finishes (offline, once no row waits): the batch ends when its last
        row does, so the draft-length planner values a row's tokens by how much sooner they end it
        (:meth:`~batchspec.engine.draft_length.AdaptiveLength._worth`)."""
        ...

    def add(self, row: Sequence) -> None:
        """Queue ``row``; it is admitted once there is room."""
        ...

    def select(self) -> list[Sequence]:
        """Admit queued rows while there is room; the rows of the next round (empty when there are none)."""
        ...

    def ran(self, rows: list[Sequence]) -> list[Sequence]:
        """Account a round over ``rows``; the rows that finished leave and are returned."""
        ...

    def remove(self, rows: list[Sequence]) -> None:
        """Drop ``rows`` (retired early: cancelled or failed), admitted or queued, between rounds."""
        ...


def make_scheduler(config: SpecConfig, *, online: bool = False) -> Scheduler:
    """The policy of ``config.method``: ExSpec's window, or EqSpec's batch."""
    from batchspec.engine.schedulers.batches import Batches
    from batchspec.engine.schedulers.pool import PooledWindow

    if config.method is Method.EXSPEC:
        return PooledWindow(
            config.batch_size, config.window, sort_by_length=config.sort_by_length and not online,
            check=config.check_invariants,
        )
    return Batches(config.batch_size, online=online)
