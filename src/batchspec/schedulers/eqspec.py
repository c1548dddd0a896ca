"""EqSpec: fixed batches of ``batch_size`` prompts in order, each decoded to completion; the batch is
realigned (unpad–append–repad) every round. Rows that finish leave their batch at once."""

from __future__ import annotations

from collections.abc import Callable

from batchspec.engine import Engine
from batchspec.state import Sequence


def run_static_batches(engine: Engine, sequences: list[Sequence], on_done: Callable[[int], None]) -> None:
    """Decode ``sequences`` in consecutive batches of ``engine.config.batch_size``."""
    size = engine.config.batch_size
    for start in range(0, len(sequences), size):
        active = sequences[start : start + size]
        while active:
            engine.step(active)
            still = [row for row in active if not row.finished]
            on_done(len(active) - len(still))
            active = still
