"""Arithmetic whose value for one row cannot depend on the rows computed beside it.

The int8 forward is batch-invariant by construction because it only uses three kinds of operation:

1. **Elementwise operations whose result depends on their operands alone**: the correctly rounded ones
   (``+ - * /``, ``floor``, ``round``, comparisons), which IEEE 754 fixes, so the vector lanes and the scalar tail
   of a CPU kernel agree whatever the tensor's shape or where the value sits in it; and torch's ``sqrt``, which is
   not always correctly rounded on the CPU (it differed from C's ``sqrtf`` in 15,509 of 100,000 random float32
   values on an AVX-512 Zen 4) but runs the same vector code on a loop's tail, so a value gets the same bits at any
   offset (``tests/test_int8.py`` checks it).
2. **Sums of integers held exactly**: the int8 product accumulates in int32 (:mod:`batchspec.int8.product`), and
   float64 holds every integer below 2**53 exactly, so a matrix product of integer-valued float64 tensors whose
   partial sums stay below 2**53 is exact, in any summation order and blocking a BLAS picks.
3. **Maxima** (``amax``), which are exact in any order.

Transcendental functions (``exp``, ``sigmoid``, ``cos``) are not in the list: torch's CPU kernels compute them
with SIMD approximations in vector lanes and with scalar code in a loop's tail, which can differ in the last bit,
and which path a value takes depends on its offset in the tensor, so on the batch (``F.silu`` of a tensor and of
the same tensor shifted by one to 39 elements differ in 147 of 39 million values on an AVX-512 CPU). So
:func:`exp2_nonpositive` builds ``2**t`` from kind-1 operations, :func:`silu_` keeps every value on torch's vector
path, and :func:`row_sum` sums a float row in an order fixed by its length.

Glossary: a *row* is the vector one reduction runs over (one token's hidden state, one head's query); *levels*
is the largest integer a quantized value may take (127 for int8).
"""

from __future__ import annotations

import math

import torch

from batchspec.int8 import native

INT8_LEVELS = 127
# 2**f on [0, 1) as a polynomial in f: the Taylor terms of exp(f ln 2); the degree-10 remainder is below 1e-8.
EXP2_COEFFICIENTS = tuple(math.log(2.0) ** i / math.factorial(i) for i in range(10))
# the smallest exponent kept: 2**-126 is float32's smallest normal number
_MIN_EXPONENT = -126.0


def quantize_rows(x: torch.Tensor, levels: int = INT8_LEVELS) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row quantization of ``x`` over its last dimension.

    Returns ``(q, scale)``: ``q`` holds integers in ``[-levels, levels]`` in ``x``'s dtype (``[..., n]``) and
    ``scale`` (``[..., 1]``) is ``max|row| / levels`` (1 for an all-zero row), so ``q * scale`` approximates ``x``.
    Each row's result depends on that row alone (a maximum, then elementwise operations).

    Example: the row ``[0.5, -1.0, 0.25]`` with 127 levels has scale ``1/127`` and ``q = [64, -127, 32]``
    (63.5 rounds half to even; the row is multiplied by 1 / scale).
    """
    top = torch.linalg.vector_norm(x, float("inf"), dim=-1, keepdim=True)  # [..., 1]: max |x|, exact
    scale = torch.where(top > 0, top / levels, 1.0)
    return (x * (1.0 / scale)).round_().clamp_(-levels, levels), scale


def exp2_nonpositive(t: torch.Tensor) -> torch.Tensor:
    """``2**t`` for ``t <= 0`` from correctly rounded operations only, so each value depends on its argument alone.

    ``2**t = 2**n * 2**f`` with ``n = floor(t)``, ``f = t - n`` in ``[0, 1)``: ``2**f`` is a degree-9 polynomial
    (relative error below 1e-8 before rounding) and ``2**n`` is built from its exponent bits. Arguments below -126
    give ``2**-126``; callers mask what must be exactly zero. ``t`` may be overwritten. A contiguous float32 ``t`` on
    a CPU with batchspec's native kernels takes :func:`~batchspec.int8.native.exp2_nonpositive_`, the same bits.
    """
    if t.dtype == torch.float32 and t.is_contiguous() and native.available():
        return native.exp2_nonpositive_(t, EXP2_COEFFICIENTS)
    t = t.clamp_(min=_MIN_EXPONENT, max=0.0)
    n = torch.floor(t)
    f = t.sub_(n)
    power = torch.full_like(f, EXP2_COEFFICIENTS[-1])
    for coefficient in reversed(EXP2_COEFFICIENTS[:-1]):
        power.mul_(f).add_(coefficient)
    return power.mul_(_power_of_two(n))


def _power_of_two(n: torch.Tensor) -> torch.Tensor:
    """``2**n`` for integer-valued ``n`` in ``[-126, 0]``, exactly: the exponent field written directly."""
    if n.dtype == torch.float64:
        return ((n.to(torch.int64) + 1023) << 52).view(torch.float64)
    if n.dtype == torch.float32:
        return ((n.to(torch.int32) + 127) << 23).view(torch.float32)
    raise TypeError(f"exp2_nonpositive takes float32 or float64, not {n.dtype}")


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """The sum over the last dimension (``[..., n] -> [..., 1]``) in an order fixed by ``n`` alone: the row is
    padded with zeros to a power of two and halved by elementwise additions (a pairwise tree), so no kernel's
    blocking or vector width enters it.

    Example: ``[a, b, c]`` is padded to ``[a, b, c, 0]``, then ``[a + c, b + 0]``, then ``[(a + c) + b]``.
    """
    width = 1 << max(0, (x.shape[-1] - 1).bit_length())
    x = torch.nn.functional.pad(x, (0, width - x.shape[-1]))
    while width > 1:
        width //= 2
        x = x[..., :width] + x[..., width:]
    return x


# torch's CPU elementwise kernels run a call of fewer elements than this on one thread (at::internal::GRAIN_SIZE),
# in steps of two SIMD vectors (at most 2 x 16 floats) from its first element; a multiple of 64 below it
_VECTOR_CALL = 32768 - 64
_VECTOR_ALIGN = 64


def silu_(x: torch.Tensor) -> torch.Tensor:
    """``F.silu`` of a contiguous ``x`` with every value computed by torch's vector path, so each depends on its
    argument alone; in place when rows are a multiple of 64 values wide, else on a padded copy. Returns the result.

    The values are taken flat in calls of a multiple of 64 elements under torch's threading grain: each call runs
    on one thread in whole double-vector steps from its first element, so no value falls in a scalar tail. (A
    polynomial like :func:`exp2_nonpositive` does this by construction but took 43x as long on the prompt
    prefill's ``[1200, 8960]`` gate: 430 vs 10 ms.)
    """
    width = x.shape[-1]
    padded = -(-width // _VECTOR_ALIGN) * _VECTOR_ALIGN
    if padded == width:
        flat = x.view(-1)
        for part in flat.split(_VECTOR_CALL) if flat.numel() > _VECTOR_CALL else (flat,):
            torch.nn.functional.silu(part, inplace=True)
        return x
    wide = torch.nn.functional.pad(x, (0, padded - width))  # [..., padded]
    return silu_(wide)[..., :width]
