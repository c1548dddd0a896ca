"""Arithmetic whose value for one row cannot depend on the rows computed beside it.

The int8 forward is batch-invariant by construction because it only uses three kinds of operation:

1. **Correctly rounded elementwise operations** (``+ - * /``, ``sqrt``, ``floor``, ``round``, comparisons), which
   IEEE 754 fixes: the vector lanes and the scalar tail of a kernel, every instruction set and every thread split
   agree on them whatever the tensor's shape or where a value sits in it. torch's float32 ``sqrt`` is not one of them
   on the CPU (it differed from the correctly rounded root in 15,509 of 100,000 random float32 values on an AVX-512
   Zen 4, through a vector library that picks its code by CPU), so :func:`sqrt_rounded` corrects a root to the
   nearest float32 by exact comparisons of squares.
2. **Sums of integers held exactly**: the int8 product accumulates in int32 (:mod:`batchspec.exact.integer.product`),
   and
   float64 holds every integer below 2**53 exactly, so a matrix product of integer-valued float64 tensors whose
   partial sums stay below 2**53 is exact, in any summation order and blocking a BLAS picks.
3. **Maxima** (``amax``), which are exact in any order.

Transcendental functions (``exp``, ``sigmoid``, ``cos``) are not in the list: torch's CPU kernels compute them
with SIMD approximations in vector lanes and with scalar code in a loop's tail, which can differ in the last bit,
and which path a value takes depends on its offset in the tensor, so on the batch and the thread count (``F.silu``
of a tensor and of the same tensor shifted by one to 39 elements differ in 147 of 39 million values on an AVX-512
CPU), and on the instruction set torch dispatches to (its AVX2 and AVX-512 SiLU agree, its scalar one does not). So
:func:`exp2_nonpositive` builds ``2**t`` from kind-1 operations, :func:`exact_silu` and :func:`exact_gelu_tanh` build
the MLP's activations on it, :func:`exact_softcap` Gemma 2's soft-capping of scores and logits, and
:func:`row_sum` sums a float row in an order fixed by its length. The native kernels
(:mod:`batchspec.exact.integer.native`) compute each of these with the same operations in the same order, so every build
and the torch path give one set of bits.

Glossary: a *row* is the vector one reduction runs over (one token's hidden state, one head's query); *levels*
is the largest integer a quantized value may take (127 for int8).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from batchspec.exact.integer import native

INT8_LEVELS = 127
# 2**f on [0, 1) as a polynomial in f: the Taylor terms of exp(f ln 2); the degree-10 remainder is below 1e-8.
EXP2_COEFFICIENTS = tuple(math.log(2.0) ** i / math.factorial(i) for i in range(10))
# log2(e), which times -|x| gives exact_silu's exponent (rounded to float32 where it multiplies float32)
LOG2E = math.log2(math.e)
# exact_gelu_tanh's constants, each a float32 value (so float32 and float64 arguments multiply by the same numbers):
# 0.044715 and 2 sqrt(2 / pi), the tanh form's cubic coefficient and twice its scale (tanh(u) = 2 sigmoid(2u) - 1)
GELU_CUBIC = 0.044714998453855515
GELU_SCALE = 1.5957691669464111
# the MLP activations the exact model computes, by transformers' name, as the native kernels number them
ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}
# the smallest exponent kept: 2**-126 is float32's smallest normal number
_MIN_EXPONENT = -126.0


def quantize_rows(x: torch.Tensor, levels: int = INT8_LEVELS) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row quantization of ``x`` over its last dimension.

    Returns ``(q, scale)``: ``q`` holds integers in ``[-levels, levels]`` in ``x``'s dtype (``[..., n]``) and
    ``scale`` (``[..., 1]``) is ``max|row| / levels``, at least the dtype's smallest normal number (so ``1 / scale``
    is finite and a zero's code is 0 however small the row; the native builds alike), and 1 for an all-zero row, so
    ``q * scale`` approximates ``x``. A row holding an inf or a NaN has scale NaN and ``q`` all 0 (every native
    build alike), so every output a product computes from it is NaN: NaN in, NaN out, the same bits everywhere. Each
    row's result depends on that row alone (a maximum, then elementwise operations).

    Example: the row ``[0.5, -1.0, 0.25]`` with 127 levels has scale ``1/127`` and ``q = [64, -127, 32]``
    (63.5 rounds half to even; the row is multiplied by 1 / scale); ``[0.5, inf, 0.25]`` has scale NaN and
    ``q = [0, 0, 0]``.
    """
    top = torch.linalg.vector_norm(x, float("inf"), dim=-1, keepdim=True)  # [..., 1]: max |x|, exact; inf or NaN
    broken = ~top.isfinite()  # [..., 1]: the row holds an inf or a NaN
    scale = torch.where(top > 0, (top / levels).clamp_(min=torch.finfo(x.dtype).tiny), 1.0)  # [..., 1]
    scale.masked_fill_(broken, math.nan)
    return (x * (1.0 / scale)).round_().clamp_(-levels, levels).masked_fill_(broken, 0.0), scale


def exp2_nonpositive(t: torch.Tensor) -> torch.Tensor:
    """``2**t`` for ``t <= 0`` from correctly rounded operations only, so each value depends on its argument alone.

    ``2**t = 2**n * 2**f`` with ``n = floor(t)``, ``f = t - n`` in ``[0, 1)``: ``2**f`` is a degree-9 polynomial
    (relative error below 1e-8 before rounding) and ``2**n`` is built from its exponent bits. Arguments below -126
    give ``2**-126``; callers mask what must be exactly zero. ``t`` may be overwritten. A contiguous float32 ``t`` on
    a CPU with batchspec's native kernels takes :func:`~batchspec.exact.integer.native.exp2_nonpositive_`, the same
    bits.
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


def exact_silu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(x)`` from kind-1 operations and :func:`exp2_nonpositive` (:func:`_sigmoid`), so each value
    depends on its argument alone, on every CPU. Within a few units in the last place of torch's ``F.silu``; a float32
    call on a CPU with batchspec's native kernels runs :func:`~batchspec.exact.integer.native.activation`, the same
    bits.

    Example: ``x = 0`` gives ``0 * (1 / 2) = 0``; ``x = -1`` gives ``-1 * (0.3679 / 1.3679) = -0.2689``.
    """
    if x.dtype == torch.float32 and native.available():
        return native.activation(x, EXP2_COEFFICIENTS, ACTIVATIONS["silu"])
    return x * _sigmoid(x)


def exact_gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU in its tanh form (transformers' ``gelu_pytorch_tanh``, torch's ``gelu(approximate="tanh")``),
    ``0.5 x (1 + tanh(u))`` with ``u = sqrt(2 / pi) (x + 0.044715 x^3)``, computed as ``x * sigmoid(2u)`` (the same
    function) from kind-1 operations and :func:`exp2_nonpositive`: ``z = (x + ((x * x) * x) * GELU_CUBIC) *
    GELU_SCALE``, each operation rounded once, then :func:`_sigmoid` of ``z`` (never an overflow), times ``x``. Each
    value depends on its argument alone, on every CPU; a float32 call on a CPU with batchspec's native kernels runs
    :func:`~batchspec.exact.integer.native.activation`, the same bits.

    Example: ``x = 0`` gives ``0``; ``x = 1`` gives ``z = 1.6671``, ``1 * 0.8412 = 0.8412``.
    """
    if x.dtype == torch.float32 and native.available():
        return native.activation(x, EXP2_COEFFICIENTS, ACTIVATIONS["gelu_pytorch_tanh"])
    z = (x + x * x * x * GELU_CUBIC) * GELU_SCALE
    return x * _sigmoid(z)


def exact_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The exact function of the MLP activation transformers calls ``name`` (a key of :data:`ACTIVATIONS`)."""
    functions = {"silu": exact_silu, "gelu_pytorch_tanh": exact_gelu_tanh}
    if name not in functions:
        raise ValueError(f"the exact model computes the activations {sorted(functions)}, not {name!r}")
    return functions[name]


def exact_softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """Gemma 2's soft-capping ``cap * tanh(x / cap)`` from kind-1 operations and :func:`exp2_nonpositive`, so each
    value depends on its argument alone, on every CPU: ``z = x / cap``, ``e = 2**((|z| * 2) * -log2 e)``
    (``exp(-2|z|)``, never an overflow), ``tanh(|z|) = (1 - e) / (1 + e)`` given ``z``'s sign, times ``cap``, each
    operation rounded once in ``x``'s dtype (``cap`` rounded to it). The native kernels' ``softcap_value``
    (``csrc/scalar.h``) is the same operations, so the fused attention's capped scores are these bits. A NaN stays
    NaN; an infinity gives ``+-cap``.

    Example: ``cap = 2``, ``x = 1`` gives ``z = 0.5``, ``e = 0.3679``, ``2 * 0.4621 = 0.9242``."""
    z = x / cap
    e = exp2_nonpositive(z.abs().mul_(2.0).mul_(-LOG2E))
    return torch.copysign((1.0 - e) / (e + 1.0), z).mul_(cap)


def _sigmoid(z: torch.Tensor) -> torch.Tensor:
    """``sigmoid(z)`` as ``(s / (1 + e))`` with ``e = 2**(|z| * -log2 e)`` (``exp(-|z|)``) and ``s = 1`` for
    ``z >= 0``, ``e`` below (the sigmoid of ``|z|`` or of ``-|z|``, never an overflow)."""
    e = exp2_nonpositive(z.abs().mul_(-LOG2E))
    return torch.where(z >= 0, 1.0, e) / (e + 1.0)


def sqrt_rounded(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded square root of float32 ``x`` (of float64 ``x``: torch's root), whatever the accuracy of
    the root it starts from: torch's float64 root (a vector library's, whose first call in a process can be far off
    on one thread: :func:`~batchspec.exact.integer.rotary.correctly_rounded`), one Newton step in float64, rounded to
    float32 ``r``, then :func:`_towards_root` twice. Zero, infinity, NaN and negative ``x`` keep IEEE's root."""
    if x.dtype != torch.float32:
        return x.sqrt()
    wide = x.double()  # [...]
    guess = wide.sqrt()
    inside = (wide > 0) & (wide < math.inf)  # [...]
    root = torch.where(inside, (guess + wide / guess) * 0.5, guess).float()  # [...]: within a step of the root
    for _ in range(2):
        root = torch.where(inside, _towards_root(root, wide), root)
    return root


def _towards_root(root: torch.Tensor, wide: torch.Tensor) -> torch.Tensor:
    """Positive float32 ``root`` moved one step up where the midpoint to the float32 above it is still below the
    exact root of ``wide`` (its square below ``wide``), one step down where the midpoint below is above it. Exact: a
    float32 has 24 bits, a midpoint between two 25 and its square 50, held exactly in float64; that square never equals
    a float32 ``wide`` (an odd 25-bit integer's square has at least 49 bits), so the nearest float32 never ties."""
    up, down = (torch.nextafter(root, torch.tensor(limit)) for limit in (math.inf, -math.inf))  # [...] each
    above = (root.double() + up.double()) * 0.5  # [...]
    below = (root.double() + down.double()) * 0.5
    moved = torch.where(above * above < wide, up, root)
    return torch.where(below * below > wide, down, moved)
