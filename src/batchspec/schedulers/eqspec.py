"""EqSpec: fixed batches of ``batch_size`` prompts in order, each decoded to completion with
unpad–append–repad after every round. Rows that finish leave their batch at once."""

from __future__ import annotations

from collections.abc import Callable

from batchspec.engine import Engine
from batchspec.state import Sequence


def run_static_batches(engine: Engine, sequences: list[Sequence], on_batch_done: Callable[[int], None]) -> None:
    """Decode ``sequences`` in consecutive batches of ``engine.config.batch_size``."""
    size = engine.config.batch_size
    for start in range(0, len(sequences), size):
        chunk = sequences[start : start + size]
        engine.decode(chunk)
        on_batch_done(len(chunk))
