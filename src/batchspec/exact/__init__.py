"""The exact modes: forwards in which each row's logits are the same bits whatever the batch, so batched
(speculative) decoding returns what the model's own one-prompt decoding returns.

* :mod:`batchspec.exact.integer` — the CPU's (``--quantize int8`` and ``int4``): integer linear layers of 8- or
  4-bit weights and integer-exact attention, with native C kernels per instruction set.
* :mod:`batchspec.exact.invariant` — CUDA's (``--batch-invariant``): Triton kernels with fixed reduction orders.
* :mod:`batchspec.exact.swap` — what both share in how they enter a transformers model.
"""
