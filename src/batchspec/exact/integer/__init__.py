"""The exact integer forwards for the CPU: linear layers of int8 or int4 weights on int8 activations, summed exactly
as integers, and a forward whose rows are batch-invariant.

:func:`quantize_model` turns a loaded float32 model of a family batchspec runs (:mod:`batchspec.families`) into one
(``--quantize int8``, or ``int4``); see :mod:`~batchspec.exact.integer.arithmetic` for why each row's logits cannot
depend on the batch. The files: ``arithmetic`` (the operations allowed), ``product`` (the int8 product's kernels),
``int4`` (the int4 weight, its layouts and product), ``linear`` (the layers), ``attention``, ``rotary`` (its table),
``smoothing`` (int8's), ``model`` (the swap), ``forward`` (the fused forward; :func:`forward_in_use` says whether it
runs a model), ``native`` and ``csrc/`` (the C kernels, a build per instruction set).
"""

from batchspec.exact.integer.forward import forward_in_use
from batchspec.exact.integer.model import (
    check_quantizable,
    check_quantize,
    cpu_default,
    quantizable,
    quantization,
    quantize_model,
    width_for,
)

__all__ = [
    "check_quantizable", "check_quantize", "cpu_default", "forward_in_use", "quantizable", "quantization",
    "quantize_model", "width_for",
]
