"""The exact int8 forward for the CPU: integer linear layers and a forward whose rows are batch-invariant.

:func:`quantize_model` turns a loaded float32 Llama/Qwen2/Mistral model into it (``--quantize int8``); see
:mod:`~batchspec.exact.int8.arithmetic` for why each row's logits cannot depend on the batch.
"""

from batchspec.exact.int8.model import (
    check_quantizable,
    check_quantize,
    cpu_default,
    quantizable,
    quantization,
    quantize_model,
)

__all__ = [
    "check_quantizable", "check_quantize", "cpu_default", "quantizable", "quantization", "quantize_model"
]
