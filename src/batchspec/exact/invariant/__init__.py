"""The batch-invariant mode (``--batch-invariant``): Triton kernels whose result for a row cannot depend on the
batch, swapped into a model (:mod:`batchspec.exact.invariant.model`; kernels in
:mod:`batchspec.exact.invariant.kernels`)."""

from batchspec.exact.invariant.model import NAME, batch_invariant, check_batch_invariant, make_batch_invariant

__all__ = ["NAME", "batch_invariant", "check_batch_invariant", "make_batch_invariant"]
