"""What the engine checks must hold: a broken one raises :class:`InvariantError`, never an ``assert`` (which
``python -O`` strips, so ``check_invariants=True`` would then check nothing)."""

from __future__ import annotations


class InvariantError(RuntimeError):
    """An invariant of batchspec's state is broken: a bug in batchspec (or in code that changed its state), not in
    the caller's input."""
