"""batchspec's own C kernels for the exact int8 forward, built once per machine for the instruction set it runs.

* :func:`linear`: the int8 product with its scales and bias applied (the ``native`` kernel of
  :mod:`batchspec.exact.integer.product`);
* :func:`quantize`: a token's quantization, straight to that kernel's codes; :func:`quantize_gated`, the MLP's
  ``act(gate) * up`` quantized so (:func:`activation`: SiLU or GELU with tanh);
* :func:`rms_norm`: :class:`~batchspec.exact.integer.model.ExactRMSNorm`;
* :func:`attention`: :func:`~batchspec.exact.integer.attention.exact_attention` over the int16 KV cache, a call per
  block
  of queries; :func:`rotary_into`, :func:`norm_quantize` and :func:`linear`'s residual, what
  :mod:`batchspec.exact.integer.forward` fuses of a decoder layer (the rotary embedding, the keys' and values' way into
  that cache, the norms' way into the products, the residual connections);
  :func:`pack_kv`, :func:`quantize_wide` and :func:`exp2_nonpositive_`, its 15-bit quantization (into the int16 KV
  cache, or float64) and its ``2**t``, for the rest.

Each gives the float32 bits of the torch code it replaces (the same correctly rounded operations in the same order,
compiled without contracting multiply-adds), in one call where torch runs 10 to 40 operations; integer sums are exact
in any order, and every row is computed whole by one thread, each thread of a call under one floating-point
environment (SSE's MXCSR at ``0x1F80``: round to nearest, no flush-to-zero, no denormals-are-zero; on aarch64 FPCR's
controls at 0, the same; the thread's own setting put back after, so ``torch.set_flush_denormal(True)`` changes
nothing). So the bits are the same on every instruction set, with any number of threads, and equal to the torch
path's (``tests/test_integer_builds.py`` runs each build this CPU supports), values that are not finite included: a
row holding an inf or a NaN quantizes to scale NaN and codes 0
(:func:`~batchspec.exact.integer.arithmetic.quantize_rows`), so its products' outputs are NaN.

There is one build per instruction set (:data:`BUILDS`: name, source, CPU features, flags), the first this CPU runs
chosen once per process, with one log line naming it:

* ``amx`` (``csrc/avx512.c`` with AMX-INT8): ``avx512vnni``'s kernels with the int8 product's row blocks on AMX
  tiles (``tdpbusd``: 16 rows by 64 codes times 64 codes by 16 outputs a tile, read from the same panels), where
  Linux grants the process the tiles' state (Sapphire Rapids and later Xeons);
* ``avx512vnni`` (``csrc/avx512.c``): 16-lane ``vpdpbusd`` on a weight laid out as panels of 64 outputs
  ``[P, G, 64, 4]``, streamed once per 240 rows (its read rates against oneDNN's, measured: docs/integer.md,
  "Speed");
* ``avxvnni`` (``csrc/avx2.c`` with VNNI): the same on 8 lanes, VEX ``vpdpbusd`` (Intel 12th gen and later, Zen 5),
  or its EVEX form on AVX-512 VNNI CPUs;
* ``avx2`` (``csrc/avx2.c``): llama.cpp's sign trick (every AVX2 CPU: Zen 1-3, Haswell and later): each code's sign
  moved onto the weight (``vpsignb``), ``vpmaddubsw`` of ``|q|`` by it (pair sums below saturation), ``vpmaddwd`` by
  ones; weights in ``[-127, 127]`` (:func:`pack` refuses -128);
* ``neon`` (``csrc/neon.c``): the portable build's C with its int8 and int4 products' dot products in NEON's
  ``sdot`` (ARMv8.2's dot product, ``asimddp`` in ``/proc/cpuinfo``: Graviton 2 and later, Ampere Altra, Apple
  silicon under Linux); ``scripts/aarch64_check.py`` compares its bits with the x86-64 builds' under ``qemu-aarch64``;
* ``portable`` (``csrc/portable.c``): plain C, no intrinsics, vectorized by the compiler for the target's baseline
  (SSE2 on x86-64, NEON on aarch64): every CPU with a C compiler and OpenMP, of any architecture (x86-64 without
  AVX2, aarch64 without ``sdot``), the same bits, slower than the SIMD builds.

``BATCHSPEC_CPU_ISA=amx|avx512vnni|avxvnni|avx2|neon|portable|none`` in the environment picks another build this CPU
runs (to compare, or to test each), or none: the int8 forward then runs in torch (``torch._int_mm`` and float64
products, the same bits, far slower). Asking for an instruction set the CPU lacks is an error, never an emulation. The C
source is compiled with the system C compiler (``$CC``, else ``cc``) into the cache directory the first time a process
asks for a build (under a second) and loaded through ``ctypes``; its OpenMP loops run on the ``libgomp`` torch has
already loaded. Where the compiler or OpenMP is missing, :func:`library` is None and one log line says why (the torch
path then runs).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import itertools
import logging
import math
import os
import platform
import subprocess
import tempfile
import types
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from batchspec.config import default_cache_dir
from batchspec.memory import weight_buffer

logger = logging.getLogger(__name__)

PANEL = 64  # outputs per panel (csrc/scalar.h)
PANEL4 = 16  # outputs per panel of the int4 weight (csrc/scalar.h)
GROUP4 = 32  # inputs per sub-block of the int4 weight
GROUP = 4  # inner positions per vpdpbusd lane
ZERO_POINT = 128  # the uint8 code of the integer 0
# |q . w| <= 127 * 127 * K stays below 2^31 (the C product's modular int32 sum is then the sum itself)
MAX_INNER = (2**31 - 1) // (127 * 127)
# the attention's query halves times 15-bit keys, 256 * 32767 * D, stay below 2^31 (csrc/scalar.h, quantize_queries)
MAX_HEAD_SIZE = 256
SCALE_BITS = 32  # the KV cache's float32 scale of a token: bit i is the parity of its integer i (csrc/scalar.h)


@dataclass(frozen=True)
class Build:
    """One build of the kernels: its ``name`` (``BATCHSPEC_CPU_ISA``'s value), its C ``source`` in ``csrc/``, and
    its ``variants``: (the CPU features it needs, as ``/proc/cpuinfo`` names them; the compiler flags), the first
    variant whose features the CPU has is the one built."""

    name: str
    source: str
    variants: tuple[tuple[frozenset[str], tuple[str, ...]], ...]


# every build, fastest first; a new build is a row here and its source. Every CPU with AVX2 has F16C, which the SIMD
# builds' int4 product reads the weight's float16 scales with (the portable build converts them with bit operations).
BUILDS: tuple[Build, ...] = (
    Build("amx", "avx512.c", (  # avx512vnni's kernels with the int8 product on AMX tiles (Sapphire Rapids and later)
        (frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c", "amx_tile", "amx_int8"}),
         ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mf16c", "-mamx-tile", "-mamx-int8")),
    )),
    Build("avx512vnni", "avx512.c", (
        (frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c"}),
         ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mf16c")),
    )),
    Build("avxvnni", "avx2.c", (  # 256-bit vpdpbusd: VEX-encoded (AVX-VNNI), else EVEX-encoded (AVX-512 VNNI)
        (frozenset({"avx2", "avx_vnni", "f16c"}), ("-mavx2", "-mavxvnni", "-mf16c")),
        (frozenset({"avx2", "avx512vl", "avx512_vnni", "f16c"}), ("-mavx2", "-mavx512vl", "-mavx512vnni", "-mf16c")),
    )),
    Build("avx2", "avx2.c", (
        (frozenset({"avx2", "f16c"}), ("-mavx2", "-mf16c")),
    )),
    Build("neon", "neon.c", (  # aarch64 with ARMv8.2's dot product instructions (sdot)
        (frozenset({"asimddp"}), ("-march=armv8.2-a+dotprod",)),
    )),
    Build("portable", "portable.c", ((frozenset(), ()),)),  # any CPU, any architecture: no features, no flags
)
ISAS: tuple[str, ...] = tuple(build.name for build in BUILDS)  # the builds' names, fastest first
NONE = "none"  # BATCHSPEC_CPU_ISA's value for no build: the torch path
_SOURCES = Path(__file__).with_name("csrc")
# the floating-point model pinned whatever the compiler's default: IEEE operations, no contraction into fused
# multiply-adds (a compiler such as icx defaults to a fast model)
_FLAGS = ("-O3", "-fno-fast-math", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
_ENVIRONMENT = "BATCHSPEC_CPU_ISA"
_chosen: str | None = None  # set by using(); None: the environment's or the CPU's choice


def pack(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(panels, sums)`` of an int8 weight ``[O, K]`` in ``[-127, 127]``: ``panels`` ``[P, G, 64, 4]`` int8 with
    ``panels[p, g, j, i] = weight[64 p + j, 4 g + i]`` (zero past ``O`` and ``K``), and ``sums`` ``[O]`` int32,
    ``128 * weight.sum(1)``, what the zero point adds to each output.

    Example: a ``[3, 5]`` weight is padded to ``[64, 8]``; ``panels[0, 1, 2, 0]`` is ``weight[2, 4]`` and
    ``panels[0, 1, 2, 1]`` is 0.
    """
    outputs, inner = weight.shape
    if weight.numel() and int(weight.min()) < -127:
        raise ValueError("an int8 weight holds -128: the kernels take weights in [-127, 127] (the avx2 build moves "
                         "each code's sign onto the weight)")
    panels, groups = -(-outputs // PANEL), -(-inner // GROUP)
    padding = (0, groups * GROUP - inner, 0, panels * PANEL - outputs)
    padded = F.pad(weight, padding) if any(padding) else weight  # [64 P, 4 G]
    sums = torch.cat([rows.sum(1, dtype=torch.int32) for rows in weight.split(PACK_ROWS)]).mul_(ZERO_POINT)  # [O]
    return padded.reshape(panels, PANEL, groups, GROUP).transpose(1, 2).contiguous(), sums


# rows summed at a time by pack: a sum in int32 widens its input, so in parts it never holds 4 bytes a weight
PACK_ROWS = 4096


def empty_pack(outputs: int, inner: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialized ``(panels [P, G, 64, 4] int8, sums [O] int32)`` for :func:`pack` of an ``[outputs, inner]``
    weight, to be filled by :func:`pack_into` a part at a time (the padding past ``O`` is zeroed here)."""
    panels = weight_buffer((-(-outputs // PANEL), -(-inner // GROUP), PANEL, GROUP), torch.int8)
    panels[-1].zero_()  # the last panel's rows past O stay 0
    return panels, torch.empty(outputs, dtype=torch.int32)


def pack_into(weight: torch.Tensor, panels: torch.Tensor, sums: torch.Tensor, start: int) -> None:
    """:func:`pack` of rows ``start ..`` of a weight (int8 ``weight`` ``[R, K]``, ``start`` a multiple of
    :data:`PANEL`) written into their place in ``panels`` and ``sums`` (:func:`empty_pack`)."""
    if start % PANEL or weight.shape[1] != panels.shape[1] * GROUP - (-weight.shape[1] % GROUP):
        raise ValueError(f"rows from {start} of width {weight.shape[1]} do not fit panels {tuple(panels.shape)}")
    part, part_sums = pack(weight)
    panels[start // PANEL : start // PANEL + part.shape[0]] = part
    sums[start : start + weight.shape[0]] = part_sums


def codes(q: torch.Tensor) -> torch.Tensor:
    """uint8 ``q + 128`` of integer-valued ``q`` in ``[-127, 127]`` (``[N, K]``), padded to ``[N, 4 G]``."""
    padding = -q.shape[-1] % GROUP
    return F.pad((q + ZERO_POINT).to(torch.uint8), (0, padding), value=ZERO_POINT)


def linear(
    codes: torch.Tensor, panels: torch.Tensor, sums: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor,
    bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``((q @ W.T) * row_scale) * col_scale (+ bias) (+ residual)`` as float32 ``[N, O]`` for :func:`codes`
    ``[N, 4 G]`` of ``q``, :func:`pack` of ``W``, ``row_scale`` ``[N, 1]``, ``col_scale`` and ``bias`` ``[O]``,
    ``residual`` ``[N, O]``, all float32: each int32 sum exact and rounded once, then each multiplication and
    addition rounded once, in that order."""
    return linear_parts(codes, panels, sums, row_scale, col_scale, bias, (sums.numel(),), residual)[0]


def linear_parts(
    codes: torch.Tensor, panels: torch.Tensor, sums: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor,
    bias: torch.Tensor | None, widths: tuple[int, ...], residual: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """:func:`linear`'s ``[N, O]`` as one contiguous float32 ``[N, width]`` per part, for a weight stacked from
    layers of ``widths`` outputs (``O`` in all; each but the last a multiple of :data:`PANEL`), in one pass.

    Example: q, k and v of widths ``(1536, 256, 256)`` stacked as one ``[2048, K]`` weight give ``[N, 1536]``,
    ``[N, 256]`` and ``[N, 256]``. ``residual`` (``[N, O]``, one part only) is added last, as in :func:`linear`."""
    (rows, inner), (count, groups), outputs = codes.shape, panels.shape[:2], sums.numel()
    fits = panels.shape[2:] == (PANEL, GROUP) and PANEL * (count - 1) < outputs <= PANEL * count
    fits = fits and inner == groups * GROUP <= MAX_INNER and row_scale.numel() == rows
    fits = fits and (codes.dtype, panels.dtype, sums.dtype) == (torch.uint8, torch.int8, torch.int32)
    fits = fits and sum(widths) == outputs and min(widths) > 0 and all(w % PANEL == 0 for w in widths[:-1])
    floats = [(row_scale, rows), (col_scale, outputs), (bias, outputs), (residual, rows * outputs)]
    fits = fits and all(t is None or (t.dtype == torch.float32 and t.numel() == size) for t, size in floats)
    fits = fits and (residual is None or (len(widths) == 1 and residual.shape[-1] == outputs))
    if not fits:
        raise ValueError(f"codes {tuple(codes.shape)} do not fit panels {tuple(panels.shape)} and their scales")
    codes, row_scale, col_scale, bias, residual = (
        None if t is None else t.contiguous() for t in (codes, row_scale, col_scale, bias, residual))
    outs = [torch.empty(rows, width) for width in widths]  # [N, width] float32 each
    starts = (ctypes.c_int64 * (len(widths) + 1))(0, *itertools.accumulate(widths))
    pointers = (ctypes.c_void_p * len(outs))(*(out.data_ptr() for out in outs))
    _library().linear(codes.data_ptr(), rows, inner, panels.data_ptr(), sums.data_ptr(), row_scale.data_ptr(),
                      col_scale.data_ptr(), _pointer(bias), groups, count, outputs, pointers, starts, len(outs),
                      _pointer(residual), torch.get_num_threads())
    return outs


def _pointer(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def linear4(
    rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor], panels: torch.Tensor, inner: int, subs: int, outputs: int,
    bias: torch.Tensor | None = None, widths: tuple[int, ...] | None = None, residual: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """The int4 product (:func:`~batchspec.exact.integer.int4.int4_product`'s bits) of activations ``rows`` =
    :func:`quantize_blocks`' ``(codes [N, 32 S], scales [N, B], sums [N, S2])`` and an int4 weight packed as
    ``panels`` (``[P, bytes]`` uint8, :func:`~batchspec.exact.integer.int4.Int4Weight.packed`) of ``outputs`` outputs,
    ``inner`` inputs and ``subs`` sub-blocks a super-block, plus ``bias`` ``[O]``, then ``residual`` ``[N, O]``:
    one float32 ``[N, width]`` per part of ``widths`` (default: one, ``O`` wide; each but the last a multiple of 16)."""
    codes, scales, sums = rows
    widths = (outputs,) if widths is None else widths
    count, panel_bytes = panels.shape
    nsub = -(-inner // GROUP4)
    fits = codes.dtype == torch.int8 and codes.shape[1] == GROUP4 * nsub and panels.dtype == torch.uint8
    fits = fits and scales.shape == (codes.shape[0], -(-nsub // subs)) and sums.shape[0] == codes.shape[0]
    fits = fits and sums.dtype == torch.int16 and sums.shape[1] >= nsub + nsub % 2 and PANEL4 * (count - 1) < outputs
    fits = fits and outputs <= PANEL4 * count and sum(widths) == outputs and all(w % PANEL4 == 0 for w in widths[:-1])
    fits = fits and all(t is None or (t.dtype == torch.float32 and t.numel() == numel)
                        for t, numel in ((bias, outputs), (residual, codes.shape[0] * outputs)))
    fits = fits and (residual is None or len(widths) == 1)
    if not fits:
        raise ValueError(f"int4 codes {tuple(codes.shape)} do not fit panels {tuple(panels.shape)} of {outputs} x "
                         f"{inner}")
    n = codes.shape[0]
    codes, scales, sums, panels, bias, residual = (
        None if t is None else t.contiguous() for t in (codes, scales, sums, panels, bias, residual))
    outs = [torch.empty(n, width) for width in widths]  # [N, width] float32 each
    starts = (ctypes.c_int64 * (len(widths) + 1))(0, *itertools.accumulate(widths))
    pointers = (ctypes.c_void_p * len(outs))(*(out.data_ptr() for out in outs))
    _library().linear4(codes.data_ptr(), n, codes.shape[1], scales.data_ptr(), scales.shape[1], sums.data_ptr(),
                       sums.shape[1], panels.data_ptr(), panel_bytes, count, nsub, subs, outputs, _pointer(bias),
                       pointers, starts, len(outs), _pointer(residual), torch.get_num_threads())
    return outs


def block_shapes(inner: int, block: int) -> tuple[int, int, int]:
    """``(padded, blocks, counted)`` of :func:`quantize_blocks` for rows of ``inner`` values in blocks of ``block``:
    the codes' width (a multiple of 32), the scales per row and the sub-block sums per row (rounded up to even).
    Example: 100 values in blocks of 64 -> (128, 2, 4)."""
    nsub = -(-inner // GROUP4)
    return GROUP4 * nsub, -(-inner // block), nsub + nsub % 2


def quantize_blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The int4 product's activations of float32 ``x`` ``[N, K]``, in blocks of ``block`` values (a multiple of 32):
    ``(codes [N, 32 S] int8, scales [N, B] float32, sums [N, S2] int16)``, the bits of
    :func:`~batchspec.exact.integer.int4.quantize_blocks`."""
    x = _block_input(x, block)
    out = _block_outputs(*x.shape, block)
    _library().quantize_blocks(x.data_ptr(), x.shape[0], x.shape[1], block, *_block_pointers(out),
                               torch.get_num_threads())
    return out


def norm_quantize_blocks(x: torch.Tensor, weight: torch.Tensor, eps: float, block: int) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`quantize_blocks` of :func:`rms_norm` of float32 ``x`` ``[N, H]``, bit for bit, in one call."""
    x = _block_input(_norm_input(x, weight), block)
    out = _block_outputs(*x.shape, block)
    _library().norm_quantize_blocks(x.data_ptr(), x.shape[0], x.shape[1], eps, weight.data_ptr(), block,
                                    *_block_pointers(out), torch.get_num_threads())
    return out


def quantize_gated_blocks(gate: torch.Tensor, up: torch.Tensor, coefficients: tuple[float, ...], block: int,
                          kind: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`quantize_blocks` of ``act(gate) * up`` (:func:`quantize_gated`'s activation ``kind``), bit for bit."""
    if up.dtype != gate.dtype or up.shape != gate.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    gate, up = _block_input(gate, block), _block_input(up, block)
    out = _block_outputs(*gate.shape, block)
    _library().quantize_gated_blocks(gate.data_ptr(), up.data_ptr(), gate.shape[0], gate.shape[1], block,
                                     *_block_pointers(out), float_table(_checked(coefficients)), kind,
                                     torch.get_num_threads())
    return out


def _block_input(x: torch.Tensor, block: int) -> torch.Tensor:
    if x.dtype != torch.float32 or x.dim() != 2 or block <= 0 or block % GROUP4:
        raise ValueError(f"block quantization takes float32 [N, K] and blocks of 32 n values, not {x.dtype} "
                         f"{tuple(x.shape)}, {block}")
    return x.contiguous()


def _block_outputs(rows: int, inner: int, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    padded, blocks, counted = block_shapes(inner, block)
    return (torch.empty(rows, padded, dtype=torch.int8), torch.empty(rows, blocks),
            torch.empty(rows, counted, dtype=torch.int16))


def _block_pointers(out: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> tuple[int, ...]:
    codes, scales, sums = out
    return (codes.shape[1], codes.data_ptr(), scales.data_ptr(), scales.shape[1], sums.data_ptr(), sums.shape[1])


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes [N, 4 G] uint8, scale [N, 1] float32)`` of float32 ``x`` ``[N, K]``: :func:`codes` of
    :func:`~batchspec.exact.integer.arithmetic.quantize_rows`' integers and its scale, bit for bit."""
    if x.dtype != torch.float32 or x.dim() != 2:
        raise ValueError(f"native quantization takes float32 [N, K], not {x.dtype} {tuple(x.shape)}")
    x = x.contiguous()
    rows, inner = x.shape
    out = torch.empty(rows, -(-inner // GROUP) * GROUP, dtype=torch.uint8)  # [N, 4 G]
    scale = torch.empty(rows, 1)  # [N, 1]
    _library().quantize(x.data_ptr(), rows, inner, out.shape[1], out.data_ptr(), scale.data_ptr(),
                        torch.get_num_threads())
    return out, scale


def quantize_gated(gate: torch.Tensor, up: torch.Tensor, coefficients: tuple[float, ...], kind: int = 0) -> tuple[
        torch.Tensor, torch.Tensor]:
    """:func:`quantize` of ``act(gate) * up`` for float32 ``gate``, ``up`` ``[N, K]``, ``act`` :func:`activation`
    ``kind`` (0: SiLU) with its bits (its ``2**t``'s ten ``coefficients``): the MLP's activation quantized a row at a
    time, never stored. Returns ``(codes [N, 4 G], scale [N, 1])``."""
    if gate.dtype != torch.float32 or gate.dim() != 2 or up.dtype != gate.dtype or up.shape != gate.shape:
        raise ValueError(f"native quantization takes float32 [N, K] twice, not {gate.dtype} {tuple(gate.shape)}, "
                         f"{up.dtype} {tuple(up.shape)}")
    table = float_table(_checked(coefficients))
    gate, up = gate.contiguous(), up.contiguous()
    rows, inner = gate.shape
    out = torch.empty(rows, -(-inner // GROUP) * GROUP, dtype=torch.uint8)  # [N, 4 G]
    scale = torch.empty(rows, 1)  # [N, 1]
    _library().quantize_gated(gate.data_ptr(), up.data_ptr(), rows, inner, out.shape[1], out.data_ptr(),
                              scale.data_ptr(), table, kind, torch.get_num_threads())
    return out, scale


def activation(x: torch.Tensor, coefficients: tuple[float, ...], kind: int) -> torch.Tensor:
    """The MLP activation ``kind`` (:data:`~batchspec.exact.integer.arithmetic.ACTIVATIONS`' code: ``exact_silu`` or
    ``exact_gelu_tanh``) of float32 ``x``, bit for bit, with its ``2**t``'s ten ``coefficients``."""
    if x.dtype != torch.float32:
        raise ValueError(f"the native activation takes float32, not {x.dtype}")
    x = x.contiguous()
    out = torch.empty_like(x)
    _library().activation(x.data_ptr(), out.data_ptr(), x.numel(), float_table(_checked(coefficients)), kind,
                          torch.get_num_threads())
    return out


def _checked(coefficients: tuple[float, ...]) -> tuple[float, ...]:
    if len(coefficients) != 10:
        raise ValueError(f"2**t takes ten coefficients, not {len(coefficients)}")
    return tuple(coefficients)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`~batchspec.exact.integer.model.exact_rms_norm` of float32 ``x`` ``[..., H]`` with ``weight`` ``[H]``,
    bit for
    bit, in one call."""
    x = _norm_input(x, weight)
    out = torch.empty_like(x)
    _library().rms_norm(x.data_ptr(), x.numel() // max(x.shape[-1], 1), x.shape[-1], eps, weight.data_ptr(),
                        out.data_ptr(), torch.get_num_threads())
    return out


def norm_quantize(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize` of :func:`rms_norm` of float32 ``x`` ``[N, H]``, bit for bit, in one call:
    ``(codes [N, 4 G], scale [N, 1])``, the normalized rows never written out."""
    x = _norm_input(x, weight)
    rows, inner = x.shape
    codes, scale = torch.empty(rows, -(-inner // GROUP) * GROUP, dtype=torch.uint8), torch.empty(rows, 1)
    _library().norm_quantize(x.data_ptr(), rows, inner, eps, weight.data_ptr(), codes.shape[1], codes.data_ptr(),
                             scale.data_ptr(), torch.get_num_threads())
    return codes, scale


def _norm_input(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x`` contiguous, once its dtype and shape fit ``weight``'s for a native RMSNorm."""
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or weight.shape != x.shape[-1:]:
        raise ValueError(f"native RMSNorm takes float32 [..., H] and [H], not {x.dtype} {tuple(x.shape)}")
    if not weight.is_contiguous():
        raise ValueError("native RMSNorm takes a contiguous weight")
    return x.contiguous()


def quantize_wide(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~batchspec.exact.integer.arithmetic.quantize_rows` of float32 ``x`` ``[..., D]`` to ``levels``, in
    float64,
    bit for bit: ``(q [..., D], scale [..., 1])``."""
    x = _wide_input(x, levels)
    size = x.shape[-1]
    q, scale = torch.empty(x.shape, dtype=torch.float64), torch.empty(*x.shape[:-1], 1, dtype=torch.float64)
    _library().quantize_wide(x.data_ptr(), x.numel() // max(size, 1), size, levels, q.data_ptr(), size,
                             scale.data_ptr(), 1, torch.get_num_threads())
    return q, scale


def packed_width(size: int) -> int:
    """int16 per token and head in the KV cache for heads of ``size`` values: one per value, and at least
    :data:`SCALE_BITS`, whose parities hold the scale's bits (see :func:`~batchspec.exact.integer.attention.pack`).
    Example: 128 -> 128, 5 -> 32."""
    return max(size, SCALE_BITS)


def pack_kv(x: torch.Tensor, levels: int, width: int) -> torch.Tensor:
    """:func:`~batchspec.exact.integer.attention.pack` of float32 keys or values ``x`` ``[..., D]``, bit for bit:
    ``[..., width]`` int16, each token's integers, the scale's bits in the parities of the first 32."""
    x = _wide_input(x, levels)
    size = x.shape[-1]
    if width != packed_width(size):
        raise ValueError(f"keys of {size} values are packed {packed_width(size)} int16 wide, not {width}")
    out = torch.empty(*x.shape[:-1], width, dtype=torch.int16)  # [..., width]
    _library().pack_kv(x.data_ptr(), x.numel() // max(size, 1), size, levels, out.data_ptr(), width,
                       torch.get_num_threads())
    return out


def rotary_into(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, query: torch.Tensor,
    keys: torch.Tensor, values: torch.Tensor, levels: int, pairs: bool = False,
) -> None:
    """A layer's float32 ``q`` ``[B, S, H, D]``, ``k`` and ``v`` ``[B, S, Hk, D]`` on their way to the attention, bit
    for bit as transformers' ``apply_rotary_pos_emb`` (with ``cos``/``sin`` ``[B, S, R]``: each head's first ``R``
    values turn, the others pass through, as Phi-3's and GLM-4's partial rotary do; ``pairs``: turned over adjacent
    pairs as GLM-4's is, not over halves) and :func:`pack_kv` give them: ``q`` rotated into ``query`` ``[B, H, S, D]``
    float32, ``k`` rotated and ``v`` as it is packed into the cache's ``keys``/``values`` ``[B, Hk, S, W]`` int16 (any
    strides but the last, 1), in one call."""
    batch, seq, heads, size = q.shape
    kv_heads, width, rotated = k.shape[2], keys.shape[-1], cos.shape[-1]
    inputs = all(t.dtype == torch.float32 and t.is_contiguous() for t in (q, k, v, cos, sin))
    inputs = inputs and k.shape == v.shape == (batch, seq, kv_heads, size)
    inputs = inputs and cos.shape == sin.shape == (batch, seq, rotated) and 0 < rotated <= size and rotated % 2 == 0
    outputs = query.dtype == torch.float32 and query.shape == (batch, heads, seq, size)
    outputs = outputs and all(t.dtype == torch.int16 and t.shape == (batch, kv_heads, seq, width)
                              for t in (keys, values))
    fits = inputs and outputs and all(t.stride(3) == 1 for t in (query, keys, values))
    if not fits or width != packed_width(size) or not 0 < levels < 2**15:
        raise ValueError(f"queries {tuple(q.shape)}, keys {tuple(k.shape)} do not fit their outputs' layout")
    strides = [(ctypes.c_int64 * 3)(*t.stride()[:3]) for t in (query, keys, values)]
    _library().rotary_into(q.data_ptr(), k.data_ptr(), v.data_ptr(), batch, seq, heads, kv_heads, size,
                           cos.data_ptr(), sin.data_ptr(), rotated, int(pairs), query.data_ptr(), strides[0],
                           keys.data_ptr(), strides[1], values.data_ptr(), strides[2], width, levels,
                           torch.get_num_threads())


def _wide_input(x: torch.Tensor, levels: int) -> torch.Tensor:
    if x.dtype != torch.float32 or not 0 < levels < 2**15:
        raise ValueError(f"native 15-bit quantization takes float32 and levels below 2**15, not {x.dtype}, {levels}")
    return x.contiguous()


def exp2_nonpositive_(t: torch.Tensor, coefficients: tuple[float, ...]) -> torch.Tensor:
    """:func:`~batchspec.exact.integer.arithmetic.exp2_nonpositive` of a contiguous float32 ``t`` in place, bit for bit,
    with its polynomial's ten ``coefficients`` (lowest degree first)."""
    if t.dtype != torch.float32 or not t.is_contiguous() or len(coefficients) != 10:
        raise ValueError("native exp2 takes a contiguous float32 tensor and ten coefficients")
    _library().exp2_nonpositive(t.data_ptr(), t.numel(), float_table(coefficients), torch.get_num_threads())
    return t


def attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor, scaling: float, levels: int,
    coefficients: tuple[float, ...], softcap: float | None = None,
) -> torch.Tensor | None:
    """:func:`~batchspec.exact.integer.attention.exact_attention`, bit for bit, for float32 ``query`` ``[B, H, Q,
    D]``, the
    int16 cache's ``key``/``value`` ``[B, Hk, L, W]`` as :func:`pack_kv` stores them (tokens contiguous),
    ``visible`` bool ``[B, 1, Q, L]``, the queries' 15-bit ``levels``, ``2**t``'s ``coefficients`` and the scores'
    ``softcap`` (None: not capped):
    ``[B, Q, H, D]`` float32; None where the tensors are not laid out so or heads are larger than
    :data:`MAX_HEAD_SIZE` (the caller then runs torch's path)."""
    batch, heads, queries, size = query.shape
    kv_heads, length, width = key.shape[1], key.shape[2], key.shape[3]
    laid_out = query.dtype == torch.float32 and visible.dtype == torch.bool and heads % kv_heads == 0
    laid_out = laid_out and size <= MAX_HEAD_SIZE and 0 < levels < 2**15 and width == packed_width(size)
    laid_out = laid_out and all(
        t.dtype == torch.int16 and t.shape == (batch, kv_heads, length, width) and t.stride()[2:] == (width, 1)
        for t in (key, value)
    )
    if not laid_out or visible.shape != (batch, 1, queries, length) or len(coefficients) != 10:
        return None
    query, out = query.contiguous(), torch.empty(batch, queries, heads, size)  # [B, Q, H, D]
    vb, _, vq, vl = visible.stride()
    failed = _library().attention(
        query.data_ptr(), key.data_ptr(), key.stride(0), key.stride(1), value.data_ptr(), value.stride(0),
        value.stride(1), width, visible.data_ptr(), vb, vq, vl, batch, heads, kv_heads, queries, length, size,
        scaling / math.log(2.0), softcap / math.log(2.0) if softcap else 0.0, levels, float_table(coefficients),
        out.data_ptr(), torch.get_num_threads(),
    )
    if failed:
        raise MemoryError(f"the native attention found no memory for {queries} queries over {length} keys")
    return out


def decoder(call: ctypes.Structure, layers: ctypes.Array) -> None:
    """Every decoder layer of ``layers`` (``layer_t`` structs) in order on the forward ``call`` (a ``decoder_t``), in
    one call: ``csrc/decoder.h``, :mod:`batchspec.exact.integer.plan`."""
    if _library().decoder(ctypes.byref(call), layers, len(layers)):
        raise MemoryError(f"the native attention found no memory for {call.seq} queries over {call.end} keys")


def layout() -> dict[tuple[str, str], int]:
    """The native decoder's structs as the build in use lays them out (``csrc/decoder.h``'s ``LAYOUT``):
    ``(typedef, field)`` to the field's offset, and ``(typedef, "")`` to the typedef's size."""
    found, at = {}, 0
    kind, field, value = ctypes.c_char_p(), ctypes.c_char_p(), ctypes.c_int64()
    while _library().layout(at, ctypes.byref(kind), ctypes.byref(field), ctypes.byref(value)):
        found[(kind.value.decode(), field.value.decode())] = value.value
        at += 1
    return found


def half_to_float(h: torch.Tensor) -> torch.Tensor:
    """float16 ``h`` as float32 by ``csrc/scalar.h``'s bit conversion (the portable build's reading of the int4 weight's
    scales, where the SIMD builds have F16C): torch's conversion of a float16 tensor, bit for bit, NaNs quieted with
    their payload kept."""
    if h.dtype != torch.float16:
        raise ValueError(f"half_to_float takes float16, not {h.dtype}")
    h, out = h.contiguous(), torch.empty(h.shape)
    _library().half_to_float(h.data_ptr(), h.numel(), out.data_ptr())
    return out


@functools.cache
def float_table(values: tuple[float, ...]) -> ctypes.Array:
    """``values`` as a C array of floats (each rounded to float32, as torch rounds a Python scalar), made once."""
    return (ctypes.c_float * len(values))(*values)


def available() -> bool:
    """Whether a build of the kernels runs here (see :func:`library`)."""
    return library() is not None


def _library() -> types.SimpleNamespace:
    functions = library()
    if functions is None:
        raise RuntimeError(f"batchspec's native int8 kernels are not in use here (instruction set: {isa()})")
    return functions


@functools.cache
def host_isas() -> tuple[str, ...]:
    """The builds of :data:`ISAS` this CPU runs, fastest first: ``portable`` on every CPU (last), the SIMD builds
    before it on Linux x86-64 and aarch64 CPUs with their features (each architecture's own: an x86-64 CPU never
    lists ``asimddp``, nor an aarch64 CPU ``avx2``). ``avxvnni`` is the 256-bit VNNI build: VEX-encoded where the CPU
    has AVX-VNNI, EVEX-encoded where it has AVX-512 VNNI."""
    flags = _cpu_flags()
    return tuple(name for name in ISAS if _build_flags(name, flags) is not None)


def _build_flags(name: str, flags: frozenset[str]) -> tuple[str, ...] | None:
    """The compiler flags of build ``name`` on a CPU with ``flags`` (:data:`BUILDS`); None where that CPU cannot run
    it."""
    build = next(build for build in BUILDS if build.name == name)
    return next((compiler for needed, compiler in build.variants if needed <= flags), None)


def isa() -> str:
    """The build in use: :func:`using`'s, else ``BATCHSPEC_CPU_ISA``'s, else the fastest this CPU runs, else
    :data:`NONE`. A value the CPU cannot run, or not one of :data:`ISAS` and ``none``, raises ValueError."""
    return _runnable(_chosen) if _chosen else _default()


@functools.cache
def _default() -> str:
    """:func:`isa` outside :func:`using`, decided once (the forward asks at every layer)."""
    return _runnable(_environment() or next(iter(host_isas()), NONE))


def _runnable(name: str) -> str:
    if name != NONE and name not in host_isas():
        known = ", ".join((*ISAS, NONE))
        reason = f"this CPU runs {', '.join(host_isas()) or 'none of them'}" if name in ISAS else f"one of {known}"
        raise ValueError(f"{_ENVIRONMENT}={name!r} is not an instruction set batchspec can use here: {reason}")
    return name


@functools.cache
def _environment() -> str:
    """``BATCHSPEC_CPU_ISA`` as the process started with it."""
    return os.environ.get(_ENVIRONMENT, "").strip().lower()


@contextlib.contextmanager
def using(name: str) -> Iterator[None]:
    """Run the kernels of build ``name`` (one of :func:`host_isas`, or ``none``) inside the block: for tests and
    benchmarks that compare builds in one process. Layers quantized under one build keep their layout under the
    others (every build takes the same prepacked weight), but not under ``none``."""
    global _chosen
    previous, _chosen = _chosen, name
    try:
        isa()
        yield
    finally:
        _chosen = previous


def library() -> types.SimpleNamespace | None:
    """The C functions of the build in use (:func:`isa`), built for this machine on first use; None for ``none``,
    or (with one log line) where it does not build."""
    return _load(isa())


@functools.cache
def _load(name: str) -> types.SimpleNamespace | None:
    """Build ``name``'s shared library (once per process and source), load it and declare its functions."""
    if name == NONE:
        logger.info("batchspec: int8 kernels: none (%s); the int8 forward runs in torch", _why_none())
        return None
    try:
        shared = ctypes.CDLL(str(_build(name)), mode=getattr(os, "RTLD_LOCAL", 0))
    except (OSError, subprocess.SubprocessError) as error:
        output = getattr(error, "stderr", None) or b""
        reason = output.decode(errors="replace").strip().splitlines()[:1] or [str(error)]
        logger.warning("batchspec: the %s int8 kernels did not build (%s); the int8 forward runs in torch", name,
                       reason[0])
        return None
    logger.info("batchspec: int8 kernels: %s (this CPU runs %s)", name, ", ".join(host_isas()))
    functions = {}
    for function_name, arguments in _signatures().items():
        function = getattr(shared, f"batchspec_{function_name}")
        function.argtypes = arguments
        function.restype = ctypes.c_int if function_name in ("attention", "decoder", "layout") else None
        functions[function_name] = function
    return types.SimpleNamespace(**functions)


def _why_none() -> str:
    if _environment() or _chosen:
        return f"{_ENVIRONMENT}=none"
    return f"no build runs on this {platform.machine() or 'unknown'} CPU"


def _signatures() -> dict[str, list]:
    """Each exported C function's argument types."""
    i64, pointer, threads, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    return {
        "linear": [pointer, i64, i64, pointer, pointer, pointer, pointer, pointer, i64, i64, i64, pointer, pointer, i64,
                   pointer, threads],
        "quantize": [pointer, i64, i64, i64, pointer, pointer, threads],
        "linear4": [pointer, i64, i64, pointer, i64, pointer, i64, pointer, i64, i64, i64, i64, i64, pointer, pointer,
                    pointer, i64, pointer, threads],
        "quantize_blocks": [pointer, i64, i64, i64, i64, pointer, pointer, i64, pointer, i64, threads],
        "norm_quantize_blocks": [pointer, i64, i64, f32, pointer, i64, i64, pointer, pointer, i64, pointer, i64,
                                 threads],
        "quantize_gated_blocks": [pointer, pointer, i64, i64, i64, i64, pointer, pointer, i64, pointer, i64, pointer,
                                  i64, threads],
        "quantize_gated": [pointer, pointer, i64, i64, i64, pointer, pointer, pointer, i64, threads],
        "activation": [pointer, pointer, i64, pointer, i64, threads],
        "rms_norm": [pointer, i64, i64, f32, pointer, pointer, threads],
        "norm_quantize": [pointer, i64, i64, f32, pointer, i64, pointer, pointer, threads],
        "quantize_wide": [pointer, i64, i64, f32, pointer, i64, pointer, i64, threads],
        "pack_kv": [pointer, i64, i64, f32, pointer, i64, threads],
        "rotary_into": [pointer, pointer, pointer, i64, i64, i64, i64, i64, pointer, pointer, i64, i64, pointer,
                        pointer, pointer, pointer, pointer, pointer, i64, f32, threads],
        "exp2_nonpositive": [pointer, i64, pointer, threads],
        "attention": [pointer, pointer, i64, i64, pointer, i64, i64, i64, pointer, i64, i64, i64, i64, i64, i64, i64,
                      i64, i64, ctypes.c_double, f32, f32, pointer, pointer, threads],
        "decoder": [pointer, pointer, i64],
        "half_to_float": [pointer, i64, pointer],
        "layout": [i64, pointer, pointer, pointer],
    }


# the line of /proc/cpuinfo that lists a CPU's features, by architecture (platform.machine())
_FEATURE_LINES = {"x86_64": "flags", "AMD64": "flags", "aarch64": "Features", "arm64": "Features"}


@functools.cache
def _cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux on x86-64 and aarch64; empty elsewhere)."""
    if platform.system() != "Linux" or platform.machine() not in _FEATURE_LINES:
        return frozenset()
    try:
        with open("/proc/cpuinfo") as info:
            flags = _features(info, platform.machine())
    except OSError:
        return frozenset()
    return flags if _tiles_permitted(flags) else flags - _TILE_FEATURES


_TILE_FEATURES = frozenset({"amx_tile", "amx_int8", "amx_bf16"})
# Linux's arch_prctl: a process asks once for the AMX tiles' state (XFEATURE_XTILEDATA) before it runs an AMX
# instruction; without that permission the first one raises SIGILL
_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18


def _tiles_permitted(flags: frozenset[str]) -> bool:
    """Whether this process may use the CPU's AMX tiles: False where the CPU has none, else Linux's answer to the
    process's request for them (granted for every thread of the process, once asked)."""
    if not flags & _TILE_FEATURES or platform.machine() not in ("x86_64", "AMD64"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0


def _features(lines: Iterable[str], machine: str) -> frozenset[str]:
    """The features of ``/proc/cpuinfo``'s ``lines`` on a ``machine`` CPU: its first ``flags`` line on x86-64, its
    first ``Features`` line on aarch64 (empty where it has none, or the machine is another).

    Example: ``Features\t: fp asimd asimddp`` on ``aarch64`` gives ``{"fp", "asimd", "asimddp"}``."""
    key = _FEATURE_LINES.get(machine)
    found = (line.split(":", 1) for line in lines if key and ":" in line)
    return next((frozenset(value.split()) for name, value in found if name.strip() == key), frozenset())


def _build(name: str) -> Path:
    """Build ``name``'s shared library, compiled into the cache directory unless a build of this source is there."""
    compiler, flags, source, target = _build_plan(name)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(handle)
    try:
        subprocess.run([compiler, *flags, str(source), "-o", partial], check=True, capture_output=True, timeout=120)
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return target


def _build_plan(name: str) -> tuple[str, tuple[str, ...], Path, Path]:
    """``(compiler, flags, source, library)`` of build ``name``: the library's file in the cache directory is named
    by a hash of the sources, the flags, the compiler and its version (another compiler, or the same one upgraded,
    builds afresh)."""
    compiler = os.environ.get("CC", "cc")
    flags = (*_FLAGS, *(_build_flags(name, _cpu_flags()) or ()))
    source = _SOURCES / next(build.source for build in BUILDS if build.name == name)
    texts = b"".join(path.read_bytes() for path in sorted(_SOURCES.iterdir()) if path.suffix in (".c", ".h"))
    words = (compiler, _compiler_version(compiler), str(source.name), *flags)
    key = hashlib.sha256(texts + " ".join(words).encode()).hexdigest()[:16]
    return compiler, flags, source, default_cache_dir() / "kernels" / f"native-{name}-{key}.so"


@functools.cache
def _compiler_version(compiler: str) -> str:
    """The first line ``compiler --version`` prints (empty where it does not run)."""
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return next(iter(done.stdout.splitlines()), "")
