"""float64 ``exp`` and ``log``, and sums in a fixed order, with the same bits on every CPU instruction set and
thread count: what the sampler (:mod:`batchspec.engine.sampling`) and the logprobs (:mod:`batchspec.engine.logprobs`)
use in place of torch's ``softmax``, ``log_softmax`` and ``sum``.

torch's CPU ``exp`` and ``log`` are vector approximations chosen per instruction set (SLEEF's for AVX2 and AVX-512,
the C library's under ``ATEN_CPU_CAPABILITY=default``), and its ``sum`` splits a row by vector width and thread,
so their last bits differ between hosts. Here:

* :func:`exp_nonpositive` and :func:`log` are fdlibm's algorithms (``e_exp.c``, ``e_log.c``) written with torch's
  correctly rounded elementwise operations only: ``+ - * /`` of two tensors or of a tensor and a float64 constant,
  comparisons, ``where``, ``round``, ``floor``, ``clamp``, integer bit operations and the reinterpretation of
  float64 bits as int64 and back. IEEE 754 fixes each of their results, so every vector lane, scalar tail,
  instruction set and thread split gives the same bits. Never ``torch.exp``/``log``/``pow``, nor ``addcmul``,
  ``lerp`` or ``sub(alpha=)``, which may fuse a multiply and an add or run code per instruction set. Both are within
  1 ulp of the exact value (fdlibm's bound; ``tests/test_sampling.py`` measures it against mpmath).
* :func:`ordered_sum` and :func:`exp_sum` add a row left to right: torch's CPU ``cumsum`` is one scalar loop per row
  (``cpu_cum_base_kernel`` in ATen's ``ReduceOpsKernel.cpp``; threads split the rows, never a row), so the last
  element of the running sum is the same bits whatever the instruction set or thread count.

On CUDA the same elementwise operations are correctly rounded too (an eager kernel per operation, nothing fused), so
:func:`exp_nonpositive` and :func:`log` give the CPU's bits; CUDA's ``cumsum`` is a parallel scan, so the sums, and
what is built on them, need not.
"""

from __future__ import annotations

import torch

# elements per block of exp on the CPU: its temporaries stay in the caches, and a block is large enough for the
# per-operation overhead (a few microseconds) to matter little
CPU_BLOCK = 1 << 16
# elements per block of rows of ordered_sum and exp_sum on the CPU (at least one row)
SUM_BLOCK = 1 << 19
# elements per block of either on other devices (CUDA): one kernel per operation, the temporaries bounded
DEVICE_BLOCK = 1 << 24

# exp: x = k ln2 + r with |r| <= ln2 / 2; ln2 = LN2_HI + LN2_LO, and LN2_HI's 32 significant bits make k * LN2_HI
# exact for |k| < 2**21 (fdlibm's constants)
_INV_LN2 = 1.44269504088896338700e00
_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10
# exp(r) = 1 + 2r / (2 - c) with c = r - r^2 (P1 + r^2 P2 + ... + r^8 P5): fdlibm's minimax coefficients
_EXP_P = (
    1.66666666666666019037e-01,
    -2.77777777770155933842e-03,
    6.61375632143793436117e-05,
    -1.65339022054652515390e-06,
    4.13813679705723846039e-08,
)
# below this the result is 0 (exp(-746) is below half the smallest subnormal); clamping there keeps k >= -1076
_EXP_LOW = -746.0
# 2**k is built as 2**(k + 64) times 2**-64: 2**(k + 64) is a normal number for every k in [-1076, 0], so the first
# product is exact and the second rounds once, into the subnormal range or not at all
_EXP_SPLIT = 64
# 1.5 * 2**52 + 1023 + 64: an integer k in [-1076, 0] added to it is exact, and the low 12 bits of the sum's bit
# pattern are then k + 1023 + 64, so shifting them left by 52 gives the bits of 2**(k + 64)
_EXPONENT_BIAS = 1.5 * 2.0**52 + 1023.0 + _EXP_SPLIT
_TWO_TO_MINUS_SPLIT = 2.0**-_EXP_SPLIT
# log(1 + f) = f - f^2/2 + s (f^2/2 + R(s^2)) with s = f / (2 + f): fdlibm's minimax coefficients of R
_LOG_LG = (
    6.666666666666735130e-01,
    3.999999999940941908e-01,
    2.857142874366239149e-01,
    2.222219843214978396e-01,
    1.818357216161805012e-01,
    1.531383769920937332e-01,
    1.479819860511658591e-01,
)
_TWO54 = 2.0**54
_SMALLEST_NORMAL = 2.0**-1022


def exp_nonpositive(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``e**x`` of float64 ``x <= 0`` elementwise, within 1 ulp, the same bits on every CPU and thread count; written
    to ``out`` (a contiguous float64 tensor of ``x``'s shape, which may be ``x`` itself) when given.

    Positive arguments are taken as 0 (the result is 1): callers shift their arguments so that the largest is 0,
    as a softmax does. ``x < -745.14``, where the exact value is below half the smallest subnormal, and ``-inf``
    give 0, NaN gives NaN; results in the subnormal range are rounded once, like any other.

    The method (fdlibm's ``e_exp.c``): ``k = round(x / ln2)``, ``r = x - k ln2`` in two parts (``hi - lo``) so the
    reduction loses nothing, ``exp(r) = 1 + (hi - (lo - r c / (c - 2)))`` with ``c`` a minimax polynomial, and the
    result ``exp(r) 2**(k + 64) 2**-64``, the power built from its exponent bits. On the CPU it runs
    :data:`CPU_BLOCK` elements at a time, so its temporaries stay in the caches.

    Example: ``exp_nonpositive(tensor([0.0, -log(2), -inf]))`` is ``[1.0, 0.5, 0.0]``.
    """
    if x.dtype != torch.float64:
        raise TypeError(f"exp_nonpositive takes float64, not {x.dtype}")
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    elif out.dtype != torch.float64 or out.shape != x.shape or not out.is_contiguous():
        raise ValueError(f"exp_nonpositive writes a contiguous float64 tensor of shape {list(x.shape)}")
    source, target = x.reshape(-1), out.view(-1)  # [n] each
    _exp_flat(source, target, _scratch(source.numel(), x.device))
    return out


def _scratch(size: int, device: torch.device) -> list[torch.Tensor]:
    """The five float64 temporaries of :func:`_exp_block` for :func:`_exp_flat` of ``size`` elements: ``[block]``
    each (at most :data:`CPU_BLOCK` elements on the CPU, :data:`DEVICE_BLOCK` elsewhere)."""
    block = min(size, CPU_BLOCK if device.type == "cpu" else DEVICE_BLOCK)
    return [torch.empty(block, dtype=torch.float64, device=device) for _ in range(5)]


def _exp_flat(source: torch.Tensor, target: torch.Tensor, scratch: list[torch.Tensor]) -> None:
    """:func:`exp_nonpositive` of ``source`` ``[n]`` into ``target`` ``[n]`` (which may be ``source``), a block of
    the scratch tensors' size at a time."""
    size, block = source.numel(), max(1, scratch[0].numel())
    for start in range(0, size, block):
        end = min(start + block, size)
        _exp_block(source[start:end], target[start:end], *(buffer[: end - start] for buffer in scratch))


def _exp_block(
    x: torch.Tensor,
    out: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    e: torch.Tensor,
) -> None:
    """:func:`exp_nonpositive` of ``x`` ``[m]`` into ``out`` ``[m]``, with ``a`` .. ``e`` ``[m]`` as scratch; ``x``
    is read once, first, so ``out`` may be ``x``. Each line is one correctly rounded operation per element (or an
    exact one: clamp, round, floor, negation, a shift of bits), in fdlibm's order."""
    torch.clamp(x, _EXP_LOW, 0.0, out=a)  # a = x within [-746, 0]; NaN stays NaN
    torch.mul(a, _INV_LN2, out=b).round_()  # b = k, in [-1076, 0]
    torch.mul(b, _LN2_HI, out=c)
    a.sub_(c)  # a = hi = x - k LN2_HI (exact)
    torch.mul(b, _LN2_LO, out=c)  # c = lo = k LN2_LO
    torch.sub(a, c, out=d)  # d = r = hi - lo
    torch.mul(d, d, out=out)  # out = t = r^2
    torch.mul(out, _EXP_P[4], out=e)
    for coefficient in reversed(_EXP_P[1:4]):
        e.add_(coefficient).mul_(out)
    e.add_(_EXP_P[0]).mul_(out)  # e = t (P1 + t (P2 + t (P3 + t (P4 + t P5))))
    torch.sub(d, e, out=e)  # e = c = r - t P(t)
    d.mul_(e)  # d = r c
    e.sub_(2.0)  # e = c - 2
    d.div_(e)  # d = r c / (c - 2) = -(r c / (2 - c))
    c.add_(d)  # c = lo - r c / (2 - c)
    torch.sub(a, c, out=c).add_(1.0)  # c = exp(r) = 1 + (hi - (lo - r c / (2 - c)))
    b.add_(_EXPONENT_BIAS).view(torch.int64).bitwise_left_shift_(52)  # b = 2**(k + 64)
    torch.mul(c, b, out=out).mul_(_TWO_TO_MINUS_SPLIT)


def log(x: torch.Tensor) -> torch.Tensor:
    """The natural logarithm of float64 ``x`` elementwise, within 1 ulp, the same bits on every CPU and thread count.

    Positive finite arguments (subnormal ones included) give finite results; 0 gives ``-inf``, ``+inf`` gives
    ``+inf``, negative arguments and NaN give NaN.

    The method (fdlibm's): ``x = 2**k m`` with ``m`` in ``[sqrt(2)/2, sqrt(2))`` from the bits of ``x``,
    ``f = m - 1``, ``log(1 + f)`` from ``s = f / (2 + f)`` and a minimax polynomial in ``s**2`` (for ``|f| < 2**-20``
    the series ``f - f^2/2 + f^3/3``), plus ``k ln2`` in two parts.

    Example: ``log(tensor([1.0, 2.0, 0.0]))`` is ``[0.0, 0.6931471805599453, -inf]``.
    """
    if x.dtype != torch.float64:
        raise TypeError(f"log takes float64, not {x.dtype}")
    finite = (x > 0) & (x < torch.inf)
    scaled = finite & (x < _SMALLEST_NORMAL)  # subnormal: times 2**54, which is exact and makes it normal
    value = torch.where(finite, torch.where(scaled, x * _TWO54, x), 1.0)  # normal, positive
    bits = value.view(torch.int64)
    high = bits >> 32  # the sign, exponent and top 20 bits of the mantissa (the sign is 0)
    mantissa = high & 0x000FFFFF
    # 1 where the mantissa is at least sqrt(2) - 1: m is then value's mantissa halved, and k one more
    halve = (mantissa + 0x95F64) & 0x100000
    k = (high >> 20) - 1023 + (halve >> 20) - torch.where(scaled, 54, 0)
    m = (((mantissa | (halve ^ 0x3FF00000)) << 32) | (bits & 0xFFFFFFFF)).view(torch.float64)
    f = m - 1.0
    dk = k.to(torch.float64)
    near_one = ((mantissa + 2) & 0x000FFFFF) < 3  # |f| < 2**-20
    series = f * f * (0.5 - 0.33333333333333333 * f)
    s = f / (f + 2.0)
    z = s * s
    w = z * z
    lg = _LOG_LG
    r = z * (lg[0] + w * (lg[2] + w * (lg[4] + w * lg[6]))) + w * (lg[1] + w * (lg[3] + w * lg[5]))
    half_square = 0.5 * f * f
    wide = ((mantissa - 0x6147A) | (0x6B851 - mantissa)) > 0  # m away from 1: the more accurate form
    result = torch.where(
        near_one,
        dk * _LN2_HI - ((series - dk * _LN2_LO) - f),
        torch.where(
            wide,
            dk * _LN2_HI - ((half_square - (s * (half_square + r) + dk * _LN2_LO)) - f),
            dk * _LN2_HI - ((s * (f - r) - dk * _LN2_LO) - f),
        ),
    )
    special = torch.where(x == 0, -torch.inf, torch.full_like(x, torch.nan))  # NaN for x < 0 and NaN
    special = torch.where(x == torch.inf, torch.inf, special)
    return torch.where(finite, result, special)


def ordered_sum(x: torch.Tensor) -> torch.Tensor:
    """``[..., 1]``: the sum of ``x`` ``[..., n]`` over its last dimension, added left to right (on the CPU; see the
    module's docstring), so its bits depend on the row alone.

    Example: ``ordered_sum(tensor([[1.0, 2.0, 3.0]]))`` is ``[[6.0]]``, computed as ``(1 + 2) + 3``.
    """
    return _ordered_sums(x, None)


def exp_sum(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``[..., 1]``: ``ordered_sum(exp_nonpositive(x - shift))`` for ``x`` ``[..., n]`` (float64, or a float type
    that converts to it exactly) and float64 ``shift`` ``[..., 1]`` (the row's maximum), the same bits, without the
    ``[..., n]`` float64 temporaries: a block of rows at a time.

    Example: ``exp_sum(tensor([[0.0, -log(2)]]), tensor([[0.0]]))`` is ``[[1.5]]``.
    """
    if shift.dtype != torch.float64:
        raise TypeError(f"exp_sum shifts by float64, not {shift.dtype}")
    return _ordered_sums(x, shift)


def _ordered_sums(x: torch.Tensor, shift: torch.Tensor | None) -> torch.Tensor:
    """:func:`ordered_sum` of ``x`` (``shift`` None) or of ``exp(x - shift)``, a block of rows at a time: each row's
    running sum is written to a scratch block (the running sums of a whole batch would be a tensor as large as
    ``x``, and allocating one costs more than the additions)."""
    n = x.shape[-1]
    rows = x.reshape(-1, n)  # [R, n]
    sums = torch.empty(rows.shape[0], 1, dtype=torch.float64, device=x.device)  # [R, 1]
    if n == 0:
        return sums.zero_().view(*x.shape[:-1], 1)
    shifts = None if shift is None else shift.expand(*x.shape[:-1], 1).reshape(-1, 1)  # [R, 1]
    step = max(1, (SUM_BLOCK if x.device.type == "cpu" else DEVICE_BLOCK) // n)  # rows per block
    running = torch.empty(min(step, rows.shape[0]), n, dtype=torch.float64, device=x.device)  # [step, n]
    scratch = None if shifts is None else _scratch(running.numel(), x.device)
    for start in range(0, rows.shape[0], step):
        block, part = rows[start : start + step], running[: min(step, rows.shape[0] - start)]  # [s, n] each
        if scratch is not None:
            torch.sub(block, shifts[start : start + step], out=part)  # [s, n], <= 0 where shift is the maximum
            _exp_flat(part.view(-1), part.view(-1), scratch)
            block = part
        torch.cumsum(block, dim=-1, out=part)
        sums[start : start + step] = part[:, -1:]
    return sums.view(*x.shape[:-1], 1)
