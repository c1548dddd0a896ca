"""Four bits a weight, eight an activation, exact integer sums: the int4 weight, its layouts and its product.

**The weight** (:class:`Int4Weight`) is GGUF's Q4_K grid: the inputs of an output channel in *sub-blocks* of 32, each
weight a nibble ``n`` in ``[0, 15]``, and ``subs`` sub-blocks a *super-block* with a float16 scale ``d`` and min scale
``dmin``; a sub-block has an integer scale ``sc`` and min ``mn`` (``[0, 255]``), and its weights are::

    w = (d * sc) * n - (dmin * mn)          (float32, as gguf's Q4_K dequantization expands them)

A GGUF file's Q4_K block (``subs = 8``: 256 inputs, 6-bit ``sc`` and ``mn``) is held as it is, and so are Q4_0 and
Q4_1 blocks (``subs = 1``: one sub-block of 32 with ``sc = mn = 1``; Q4_0's ``n - 8`` is ``dmin = 8 d``, Q4_1's ``+ m``
is ``dmin = -m``): :func:`from_gguf` reads a file's own values, never a re-rounding of their dequantization. A float
weight is rounded to the nearest point of such a grid (:func:`from_float`: ``subs = 8``, 8-bit ``sc`` and ``mn``).

**The activations** (:func:`quantize_blocks`) are int8 codes with one scale per super-block of the row (``max|x| /
127`` over its ``32 * subs`` values), as llama.cpp quantizes them for its K-quants: a channel with outliers
coarsens only its own block, so no smoothing is needed (nor possible: a file's values cannot absorb one).

**The product** (:func:`int4_product`) of a row ``q`` and an output channel sums, per super-block::

    i1 = sum_s sc[s] * (q . n over sub-block s)      i2 = sum_s mn[s] * (sum of q over sub-block s)

exactly, as integers (``|i1| <= 8 * 255 * 32 * 127 * 15 < 2**31``), then joins the super-blocks in order, each step
rounded once in float32: ``y = y + (((float)i1 * d - (float)i2 * dmin) * scale)`` from ``y = 0``, then ``+ bias``. No
value depends on another row, on the blocking or on the instruction set, so every row's output is the same bits in
any batch, on every build and with any thread count — the int8 product's promise, at half the bytes. The native
kernels (:func:`batchspec.exact.integer.native.linear4`) read the weight as :meth:`Int4Weight.packed` lays it out
(``csrc/scalar.h``); this module's torch code is their reference and the path without them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from batchspec.exact.integer import native
from batchspec.exact.integer.arithmetic import quantize_rows
from batchspec.memory import weight_buffer

SUB_BLOCK = native.GROUP4  # inputs a sub-block
SUBS = 8  # sub-blocks a super-block in from_float and Q4_K
LEVELS4 = 15  # the largest nibble
SCALE_LEVELS = 255  # the largest sub-block scale or min from_float writes
GGUF_INT4 = ("Q4_0", "Q4_1", "Q4_K")  # the GGUF block types held as int4
_ROW_CHUNK = 64  # rows a torch product holds at once ([64, O, S] float64 sums)


@dataclass(frozen=True)
class Int4Weight:
    """An int4 weight ``[O, K]`` (see the module docstring): ``nibbles`` ``[O, 32 S]`` uint8 (zeros past ``K``),
    ``scales`` and ``mins`` ``[O, S]`` uint8 (``sc``, ``mn``), ``d`` and ``dmin`` ``[O, B]`` float16, ``subs``
    sub-blocks a super-block (``B = ceil(S / subs)``; the last may hold fewer), ``inner`` = ``K``."""

    nibbles: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor
    d: torch.Tensor
    dmin: torch.Tensor
    subs: int
    inner: int

    def __post_init__(self) -> None:
        outputs, padded = self.nibbles.shape
        sub_blocks = -(-self.inner // SUB_BLOCK)
        blocks = -(-sub_blocks // self.subs)
        shapes = (padded == SUB_BLOCK * sub_blocks and self.scales.shape == self.mins.shape == (outputs, sub_blocks)
                  and self.d.shape == self.dmin.shape == (outputs, blocks))
        types = (self.nibbles.dtype == self.scales.dtype == self.mins.dtype == torch.uint8
                 and self.d.dtype == self.dmin.dtype == torch.float16)
        if not shapes or not types or self.subs < 1 or (self.subs == 1 and bool((self.scales != 1).any())):
            raise ValueError(f"an int4 weight of {outputs} x {self.inner} in super-blocks of {self.subs} does not "
                             "hold these tensors")

    @property
    def outputs(self) -> int:
        return self.nibbles.shape[0]

    @property
    def block(self) -> int:
        """Inputs a super-block: the activations' quantization block."""
        return SUB_BLOCK * self.subs

    def values(self) -> torch.Tensor:
        """The float32 weight ``[O, K]``: ``(d * sc) * n - (dmin * mn)``, each product and the difference rounded once,
        as gguf's Q4_K dequantization computes it."""
        d = self.d.float().repeat_interleave(self.subs, 1)[:, : self.scales.shape[1]]  # [O, S]
        dmin = self.dmin.float().repeat_interleave(self.subs, 1)[:, : self.scales.shape[1]]  # [O, S]
        step = (d * self.scales.float())[..., None]  # [O, S, 1]
        low = (dmin * self.mins.float())[..., None]  # [O, S, 1]
        n = self.nibbles.float().view(self.outputs, -1, SUB_BLOCK)  # [O, S, 32]
        return (step * n - low).view(self.outputs, -1)[:, : self.inner]

    def nbytes(self) -> int:
        """Bytes a product reads: the packed weight (:meth:`packed`)."""
        sub_blocks = self.scales.shape[1]
        panels = -(-self.outputs // native.PANEL4)
        return panels * _panel_bytes(sub_blocks, self.subs)

    def packed(self) -> torch.Tensor:
        """The weight as the native kernels read it, ``[P, bytes]`` uint8: panels of 16 outputs, each its
        super-blocks in order, each ``d``, ``dmin`` (float16 ``[16]``), then where ``subs > 1`` ``sc`` ``[E, 16]`` and
        ``mn`` ``[E / 2, 16, 2]`` (E: the super-block's sub-blocks rounded up to even), then the nibbles
        ``[count, 4, 16, 4]``, two a byte (input ``8 g + i`` low, ``8 g + 4 + i`` high), as ``csrc/scalar.h`` says."""
        panels = -(-self.outputs // native.PANEL4)
        rows = panels * native.PANEL4 - self.outputs

        def by_panel(t: torch.Tensor) -> torch.Tensor:  # [O, ...] -> [P, 16, ...]
            return F.pad(t, (0, 0) * (t.dim() - 1) + (0, rows)).view(panels, native.PANEL4, *t.shape[1:])

        nibbles, scales, mins = by_panel(self.nibbles), by_panel(self.scales), by_panel(self.mins)
        d, dmin = by_panel(self.d), by_panel(self.dmin)
        parts = []
        sub_blocks = self.scales.shape[1]
        for b, first in enumerate(range(0, sub_blocks, self.subs)):
            count = min(self.subs, sub_blocks - first)
            parts += [d[:, :, b].contiguous().view(torch.uint8), dmin[:, :, b].contiguous().view(torch.uint8)]
            if self.subs > 1:
                even = count + count % 2
                sc = F.pad(scales[:, :, first : first + count], (0, even - count))  # [P, 16, E]
                mn = F.pad(mins[:, :, first : first + count], (0, even - count))  # [P, 16, E]
                parts += [sc.transpose(1, 2).reshape(panels, -1),
                          mn.view(panels, native.PANEL4, even // 2, 2).transpose(1, 2).reshape(panels, -1)]
            n = nibbles[:, :, SUB_BLOCK * first : SUB_BLOCK * (first + count)]  # [P, 16, 32 count]
            n = n.reshape(panels, native.PANEL4, count, 4, 2, 4)  # [P, 16, s, g, low/high, i]
            two = n[..., 0, :] | (n[..., 1, :] << 4)  # [P, 16, s, g, i]
            parts.append(two.permute(0, 2, 3, 1, 4).reshape(panels, -1))
        return torch.cat(parts, 1, out=weight_buffer((panels, sum(part.shape[1] for part in parts)), torch.uint8))


def _panel_bytes(sub_blocks: int, subs: int) -> int:
    """Bytes of one packed panel (``csrc/scalar.h``'s super_block_bytes, summed)."""
    total = 0
    for first in range(0, sub_blocks, subs):
        count = min(subs, sub_blocks - first)
        total += 64 + (32 * (count + count % 2) if subs > 1 else 0) + 256 * count
    return total


def from_float(weight: torch.Tensor) -> Int4Weight:
    """``weight`` (``[O, K]``) rounded to the nearest point of an int4 grid of super-blocks of 8 sub-blocks: each
    sub-block's range ``[min(w, 0), max(w, 0)]`` in 15 steps, its step and its low end rounded to 8-bit multiples of
    the super-block's float16 ``d`` and ``dmin``, then each weight to the nearest nibble on that grid."""
    outputs, inner = weight.shape
    sub_blocks = -(-inner // SUB_BLOCK)
    blocks = -(-sub_blocks // SUBS)
    w = F.pad(weight.detach().float(), (0, SUB_BLOCK * sub_blocks - inner)).view(outputs, sub_blocks, SUB_BLOCK)
    low = w.amin(-1).clamp(max=0.0).neg_()  # [O, S]: the sub-block's min, as a non-negative offset
    step = (w.amax(-1).clamp(min=0.0) + low) / LEVELS4  # [O, S]
    d, scales = _scaled(step, blocks)
    dmin, mins = _scaled(low, blocks)
    grid = (d.float().repeat_interleave(SUBS, 1)[:, :sub_blocks] * scales.float())[..., None]  # [O, S, 1]
    offset = (dmin.float().repeat_interleave(SUBS, 1)[:, :sub_blocks] * mins.float())[..., None]  # [O, S, 1]
    nibbles = torch.where(grid > 0, ((w + offset) / grid).round_(), 0.0).clamp_(0, LEVELS4)
    return Int4Weight(nibbles.to(torch.uint8).view(outputs, -1), scales, mins, d, dmin, SUBS, inner)


def _scaled(values: torch.Tensor, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(unit [O, B] float16, integers [O, S] uint8)`` with ``unit * integer`` near ``values`` (``[O, S]``, >= 0):
    the unit is the super-block's largest value over 255, rounded to float16."""
    outputs, sub_blocks = values.shape
    wide = F.pad(values, (0, blocks * SUBS - sub_blocks)).view(outputs, blocks, SUBS)
    unit = (wide.amax(-1) / SCALE_LEVELS).half()  # [O, B]
    per_sub = unit.float().repeat_interleave(SUBS, 1)[:, :sub_blocks]  # [O, S]
    integers = torch.where(per_sub > 0, values / per_sub, 0.0).round_().clamp_(0, SCALE_LEVELS)
    return unit, integers.to(torch.uint8)


def from_gguf(kind: str, blocks: np.ndarray | torch.Tensor, inner: int) -> Int4Weight:
    """The int4 weight holding a GGUF tensor's own values: ``blocks`` ``[O, bytes]`` uint8, each row of
    ``inner`` inputs in ``kind`` blocks (one of :data:`GGUF_INT4`)."""
    if isinstance(blocks, np.ndarray):
        blocks = torch.from_numpy(np.array(blocks, dtype=np.uint8))
    raw = blocks.view(torch.uint8)
    outputs = raw.shape[0]
    if kind == "Q4_K":
        return _from_q4_k(raw.view(outputs, -1, 144), inner)
    if kind in ("Q4_0", "Q4_1"):
        size = 18 if kind == "Q4_0" else 20
        return _from_q4_small(raw.view(outputs, -1, size), inner, kind)
    raise ValueError(f"GGUF blocks of {kind} are not 4-bit blocks int4 holds ({', '.join(GGUF_INT4)})")


def _from_q4_k(raw: torch.Tensor, inner: int) -> Int4Weight:
    """Q4_K: per 256 inputs float16 ``d``, ``dmin``, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles (32 bytes
    hold sub-block ``2 c`` in their low nibbles and ``2 c + 1`` in their high)."""
    outputs, blocks, _ = raw.shape
    d, dmin = (raw[..., i : i + 2].contiguous().view(torch.float16)[..., 0] for i in (0, 2))  # [O, B] each
    packed = raw[..., 4:16].reshape(outputs, blocks, 3, 4).to(torch.int32)
    low, high, rest = packed.unbind(2)  # [O, B, 4] each
    scales = torch.cat([low & 0x3F, (rest & 0x0F) | ((low >> 2) & 0x30)], -1)  # [O, B, 8]
    mins = torch.cat([high & 0x3F, (rest >> 4) | ((high >> 2) & 0x30)], -1)  # [O, B, 8]
    qs = raw[..., 16:].reshape(outputs, blocks, 4, 32)
    nibbles = torch.stack([qs & 0x0F, qs >> 4], 3)  # [O, B, 4, 2, 32]: sub-block 2 c + h
    return Int4Weight(nibbles.reshape(outputs, -1), scales.reshape(outputs, -1).to(torch.uint8),
                      mins.reshape(outputs, -1).to(torch.uint8), d, dmin, SUBS, inner)


def _from_q4_small(raw: torch.Tensor, inner: int, kind: str) -> Int4Weight:
    """Q4_0 (float16 ``d``, 16 bytes) and Q4_1 (``d``, ``m``, 16 bytes) blocks of 32: inputs 0-15 in the low nibbles,
    16-31 in the high; ``d (n - 8)`` is ``d n - (8 d) 1`` and ``d n + m`` is ``d n - (-m) 1``."""
    outputs, blocks, _ = raw.shape
    d = raw[..., 0:2].contiguous().view(torch.float16)[..., 0]  # [O, B]
    if kind == "Q4_0":
        dmin = (d.float() * 8).half()
        if not torch.equal(dmin.float(), d.float() * 8):
            raise ValueError("a Q4_0 scale is too large for its min (8 d) in float16")
        qs = raw[..., 2:]
    else:
        dmin, qs = -raw[..., 2:4].contiguous().view(torch.float16)[..., 0], raw[..., 4:]
    nibbles = torch.cat([qs & 0x0F, qs >> 4], -1)  # [O, B, 32]
    ones = torch.ones(outputs, blocks, dtype=torch.uint8)
    return Int4Weight(nibbles.reshape(outputs, -1), ones, ones, d, dmin, 1, inner)


def quantize_blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float32 ``x`` ``[N, K]`` as the int4 product's activations, per block of ``block`` values (a super-block):
    ``(codes [N, 32 S] int8, scales [N, B] float32, sums [N, S2] int16)`` — each block quantized as
    :func:`~batchspec.exact.integer.arithmetic.quantize_rows` quantizes a token (a block holding an inf or a NaN: scale
    NaN, codes 0), zeros past ``K``, and each sub-block's sum of codes (zeros up to an even count). Runs
    :func:`~batchspec.exact.integer.native.quantize_blocks` where a native build does, the same bits.

    Example: 40 values in blocks of 32 give codes ``[N, 64]``, scales ``[N, 2]`` and sums ``[N, 2]``."""
    if native.available() and x.dtype == torch.float32:
        return native.quantize_blocks(x.reshape(-1, x.shape[-1]), block)
    rows, inner = x.shape
    padded, blocks, counted = native.block_shapes(inner, block)
    wide = F.pad(x.float(), (0, blocks * block - inner)).view(rows, blocks, block)
    q, scale = quantize_rows(wide)  # [N, B, block], [N, B, 1]
    codes = q.view(rows, -1)[:, :padded]  # [N, 32 S]
    sums = F.pad(codes.view(rows, -1, SUB_BLOCK).sum(-1), (0, counted - padded // SUB_BLOCK))  # [N, S2]
    return codes.to(torch.int8), scale[..., 0], sums.to(torch.int16)


def int4_product(rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor], weight: Int4Weight,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """``[N, O]`` float32: the int4 product of activations ``rows`` (:func:`quantize_blocks`, blocks of
    ``weight.block``) and ``weight``, plus ``bias``, as the module docstring defines it (the integer sums in float64,
    exact below 2**53)."""
    codes, scales, sums = rows
    outputs, sub_blocks = weight.outputs, weight.scales.shape[1]
    n = weight.nibbles.double().view(outputs, sub_blocks, SUB_BLOCK)  # [O, S, 32]
    out = []
    for start in range(0, codes.shape[0], _ROW_CHUNK):
        q = codes[start : start + _ROW_CHUNK].double().view(-1, sub_blocks, SUB_BLOCK)  # [n, S, 32]
        dots = torch.einsum("nsk,osk->nos", q, n) * weight.scales.double()  # [n, O, S]
        lows = sums[start : start + _ROW_CHUNK, None, :sub_blocks].double() * weight.mins.double()  # [n, O, S]
        y = torch.zeros(q.shape[0], outputs)  # [n, O]
        for b, first in enumerate(range(0, sub_blocks, weight.subs)):
            i1 = dots[..., first : first + weight.subs].sum(-1).float()  # [n, O]: exact integers, rounded once
            i2 = lows[..., first : first + weight.subs].sum(-1).float()  # [n, O]
            t = i1 * weight.d[:, b].float() - i2 * weight.dmin[:, b].float()
            y = y + t * scales[start : start + _ROW_CHUNK, b : b + 1]
        out.append(y if bias is None else y + bias)
    return torch.cat(out)
