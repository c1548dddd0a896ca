"""The exact int8 matrix product ``codes @ weight.T``, on the fastest kernel this CPU runs exactly.

Every kernel here sums int8 products in int32, which is exact in any order or blocking; what differs is how fast it
reads the weight and whether its products saturate. :func:`product_kernel` picks, for each layer, the first of:

* ``"native"``: batchspec's own kernel for this CPU's instruction set (:func:`batchspec.exact.integer.native.linear`:
  AVX-512 VNNI, AVX-VNNI, AVX2, or the portable C build on any other CPU), on a weight prepacked in panels of 64
  outputs, activations as ``uint8`` ``q + 128``, the zero point's share subtracted in int32 (the portable build sums
  ``q`` itself), the sum rounded once to float32. It reads weights faster than oneDNN
  and has no per-call overhead to speak of (the measured rates: docs/integer.md, "Speed"). Taken where a build runs
  (:func:`batchspec.exact.integer.native.isa`) and a worst-case probe is exact, for float32 activations.
* ``"onednn"``: oneDNN's quantized linear with the weight **prepacked once** in the blocked layout its VNNI kernel reads
  (``onednn::qlinear_prepack``); activations enter as ``uint8`` codes ``q + 128`` with zero point 128, and the result
  comes back as float32 with unit scales, which is the int32 sum rounded once to float32 — the bits ``acc.float()``
  gives. It reads a weight about twice as fast as ``torch._int_mm`` on an unpacked weight, which oneDNN lays out again
  on every call (docs/integer.md). Taken only where a worst-case probe is exact (CPUs without VNNI saturate u8 x s8
  pairs), for float32 activations (float64 ones keep the int32 sum unrounded) and for weights of at least
  :data:`ONEDNN_MIN_WEIGHT` values.
* ``"int_mm"``: ``torch._int_mm`` on the weight as ``[K, O]``.
* ``"int_mm_split"``: the same on a CPU whose int8 product saturates (no VNNI), with the weight in exact halves
  ``weight = 2 * high + low`` (:func:`split_weight`), each product small enough not to saturate.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from batchspec.exact.integer import native
from batchspec.exact.integer.arithmetic import INT8_LEVELS

logger = logging.getLogger(__name__)

KERNELS: tuple[str, ...] = ("native", "onednn", "int_mm", "int_mm_split")
# weights of fewer values take torch._int_mm: oneDNN's quantized linear spends ~20 us a call before it reads the
# weight, and _int_mm was as fast or faster below this size (576 x 576: 20 against 31 us for one row; 896 x 896:
# 57 against 50 us), on a 2-core AMD EPYC Zen 4
ONEDNN_MIN_WEIGHT = 1 << 19


@dataclass(frozen=True)
class PackedWeight:
    """An int8 weight ``[O, K]`` laid out once for ``kernel``: ``tensors`` is the prepacked weight with its unit scales
    and zero points (``onednn``), the panels and zero-point sums of :func:`batchspec.exact.integer.native.pack`
    (``native``), ``([K, O],)`` (``int_mm``) or its two halves ``[K, O]`` (``int_mm_split``)."""

    kernel: str
    tensors: tuple[torch.Tensor, ...]

    def nbytes(self) -> int:
        """Bytes a product reads of the weight (the prepacked or integer tensors, not the unit scales)."""
        weights = self.tensors[:1] if self.kernel in ("onednn", "native") else self.tensors
        return sum(t.numel() * t.element_size() for t in weights)


def pack_weight(weight: torch.Tensor, kernel: str) -> PackedWeight:
    """``weight`` (int8 ``[O, K]``) laid out for ``kernel`` (one of :data:`KERNELS`)."""
    if kernel == "native":
        return PackedWeight(kernel, native.pack(weight))
    if kernel == "onednn":
        ones, zeros = torch.ones(weight.shape[0]), torch.zeros(weight.shape[0], dtype=torch.long)  # [O] each
        packed = torch.ops.onednn.qlinear_prepack(weight.contiguous(), None)
        return PackedWeight(kernel, (packed, ones, zeros))
    transposed = weight.T  # [K, O]
    return PackedWeight(kernel, split_weight(transposed) if kernel == "int_mm_split" else (transposed.contiguous(),))


def activation_codes(q: torch.Tensor, kernel: str) -> torch.Tensor:
    """The codes ``kernel`` takes for integer-valued ``q`` in ``[-127, 127]`` (``[N, K]``): ``uint8`` ``q + 128``
    for ``onednn`` (for ``native``, padded to a multiple of 4 columns), else ``int8`` ``q``."""
    if kernel == "native":
        return native.codes(q)
    if kernel == "onednn":
        return (q + native.ZERO_POINT).to(torch.uint8)
    return q.to(torch.int8)


def int_product(codes: torch.Tensor, weight: PackedWeight, dtype: torch.dtype) -> torch.Tensor:
    """``q @ W.T`` for the activations whose :func:`activation_codes` for ``weight.kernel`` are ``codes``
    (``[N, K]``) -> ``[N, O]`` in ``dtype`` (float32 for ``native`` and ``onednn``): each integer sum exact, then
    rounded once to ``dtype``."""
    if weight.kernel == "native":
        panels, sums = weight.tensors
        return native.linear(codes, panels, sums, torch.ones(codes.shape[0], 1), torch.ones(sums.numel()))
    if weight.kernel == "onednn":
        packed, ones, zeros = weight.tensors
        return torch.ops.onednn.qlinear_pointwise(
            codes, 1.0, native.ZERO_POINT, packed, ones, zeros, None, 1.0, 0, torch.float32, "none", [], ""
        )
    if weight.kernel == "int_mm":
        return torch._int_mm(codes, weight.tensors[0]).to(dtype)
    high, low = weight.tensors
    return (torch._int_mm(codes, high) * 2 + torch._int_mm(codes, low)).to(dtype)


def split_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(high, low)`` int8 with ``weight = 2 * high + low``, ``high`` in ``[-64, 63]`` and ``low`` in ``{0, 1}``."""
    high = torch.div(weight, 2, rounding_mode="floor")
    return high.contiguous(), (weight - 2 * high).contiguous()


def product_kernel(dtype: torch.dtype, weight_size: int = ONEDNN_MIN_WEIGHT) -> str:
    """The kernel :func:`int_product` runs for activations of ``dtype`` and a weight of ``weight_size`` values on
    this CPU (one of :data:`KERNELS`)."""
    return next(k for k in exact_kernels(dtype) if k != "onednn" or weight_size >= ONEDNN_MIN_WEIGHT)


def exact_kernels(dtype: torch.dtype) -> tuple[str, ...]:
    """The kernels that give exact sums on this CPU for activations of ``dtype``, fastest first."""
    if dtype != torch.float32:
        return ("int_mm_split" if int_mm_saturates() else "int_mm",)
    fast = [k for k, exact in (("native", native.available() and _native_exact(native.isa())),
                               ("onednn", _onednn_exact())) if exact]
    kernels = (*fast, "int_mm_split" if int_mm_saturates() else "int_mm")
    if native.available() and "native" not in fast:
        _say_inexact(native.isa(), kernels[0])
    return kernels


@functools.cache
def _say_inexact(isa: str, kernel: str) -> None:
    """One log line: the build's product failed its exactness check, so ``kernel`` runs the int8 products."""
    logger.warning("batchspec: the %s build's int8 product did not give the exact sums on its check; the products "
                   "run on %s", isa, kernel)


def _extreme_operands(inner: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Worst-case int8 operands ``a`` ``[33, inner]`` and ``w`` ``[64, inner]``: full-range rows and columns, both
    signs."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randint(-INT8_LEVELS, INT8_LEVELS + 1, (33, inner), dtype=torch.int8, generator=generator)
    w = torch.randint(-INT8_LEVELS, INT8_LEVELS + 1, (64, inner), dtype=torch.int8, generator=generator)
    a[0], a[1], w[0], w[1] = INT8_LEVELS, -INT8_LEVELS, INT8_LEVELS, -INT8_LEVELS
    return a, w


@functools.cache
def int_mm_saturates() -> bool:
    """Whether ``torch._int_mm`` on this CPU loses exactness on full-range int8 operands.

    oneDNN's int8 kernels for CPUs without VNNI multiply through ``vpmaddubsw``, whose int16 pair sums saturate
    once weights exceed 64 in magnitude; VNNI CPUs (and GPUs) accumulate exactly. Checked once per process by
    multiplying worst-case operands and comparing with float64, which holds these sums exactly.
    """
    a, w = _extreme_operands()
    return not torch.equal(torch._int_mm(a, w.T.contiguous()).double(), a.double() @ w.double().T)


@functools.cache
def _native_exact(isa: str) -> bool:
    """Whether batchspec's kernel for ``isa`` (the build in use) gives the exact sums, rounded once to float32, on
    worst-case operands for 1, 7 and 33 rows and an inner size that is not a multiple of 4 (once per process and
    build)."""
    a, w = _extreme_operands()
    return _exact_on("native", a[:, :-3], w[:, :-3], (1, 7, 33))  # [33, 253], [64, 253]


ONEDNN_CHECK_INNER = 2048  # inputs of _onednn_exact's operands: 127 * 127 * 2048 > 2**24


@functools.cache
def _onednn_exact() -> bool:
    """Whether oneDNN's prepacked quantized linear exists here and gives the exact sums, rounded once to float32, on
    worst-case operands for 1, 2, 8 and 33 rows of 2048 inputs, whose sums pass 2**24 (checked once per process). On
    CPUs with AMX-INT8 (a 2-core Sapphire Rapids Xeon, torch 2.13.0) its product of 8 rows or more and over 1,024
    inputs differs from the exact sum rounded once in a few outputs of each row (as if its int32 sums of blocks were
    added in float32), while 256 inputs are exact at any row count: so the check takes sums past float32's integers."""
    quantized = getattr(torch.ops, "onednn", None)
    if quantized is None or not hasattr(quantized, "qlinear_pointwise") or not torch.backends.mkldnn.is_available():
        return False
    try:
        return _exact_on("onednn", *_extreme_operands(ONEDNN_CHECK_INNER), (1, 2, 8, 33))
    except RuntimeError:
        return False


def _exact_on(kernel: str, a: torch.Tensor, w: torch.Tensor, counts: tuple[int, ...]) -> bool:
    """Whether ``kernel`` gives ``a @ w.T`` (int8 ``[N, K]``, ``[O, K]``) as the exact sums rounded once to float32
    for the first ``counts`` rows of ``a``."""
    weight, codes = pack_weight(w, kernel), activation_codes(a.float(), kernel)
    exact = (a.double() @ w.double().T).float()  # [N, O]
    return all(torch.equal(int_product(codes[:n], weight, torch.float32), exact[:n]) for n in counts)
