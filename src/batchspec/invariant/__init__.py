"""The batch-invariant mode (``--batch-invariant``): Triton kernels whose result for a row cannot depend on the
batch, swapped into a model (:mod:`batchspec.invariant.model`; kernels in :mod:`batchspec.invariant.kernels`)."""

from batchspec.invariant.model import NAME, batch_invariant, check_batch_invariant, make_batch_invariant

__all__ = ["NAME", "batch_invariant", "check_batch_invariant", "make_batch_invariant"]
