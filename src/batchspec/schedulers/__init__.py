"""Schedulers decide which sequences are decoded together in every round.

* :mod:`~batchspec.schedulers.eqspec`: fixed batches in prompt order (EqSpec, and the autoregressive baseline).
* :mod:`~batchspec.schedulers.exspec`: a sliding window over a sequence pool, rows grouped by length (ExSpec).
"""

from batchspec.schedulers.eqspec import run_static_batches
from batchspec.schedulers.exspec import SequencePool, run_exspec

__all__ = ["SequencePool", "run_exspec", "run_static_batches"]
