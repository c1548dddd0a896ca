"""Triton kernels whose result for one row cannot depend on the other rows of the call (``--batch-invariant``).

A row's result depends on the batch when a library picks its reduction order by the shape of the whole call: a
matrix product split along K differently for 1 row than for 40, a mean whose blocking depends on how many rows
share the launch, an attention kernel that splits the keys of a one-query step but not of a five-query block. The
kernels here fix every reduction order by constants alone:

* :func:`matmul` ``x @ w.T``: tiles of :data:`MATMUL_TILES` chosen once (never tuned by the row count), no split-K;
  each output element sums its K blocks in order, and a tile's rows never mix, so a row's result is the same in any
  call, alone or among others.
* :func:`rms_norm`: one row per program, its squares summed in blocks of a width fixed by the hidden size.
* :func:`attention`: per (row, head, block of queries), an online softmax over blocks of :data:`KEY_BLOCK` keys
  **anchored at the row's first real key** (its left padding): a row alone and the same row padded in a batch see
  the same blocks, and a query sees the same blocks whether it is the only query or one of a verification's ``k+1``.
  Keys a query does not see (padding, causality, the cache's spare columns) count exactly nothing: a block with no
  visible key leaves the running maximum, the normaliser and the sum as they were (a factor of exactly 1, terms of
  exactly 0).

Accumulation is in float32 (float64 inputs in float64, for tests); float32 products are IEEE, not TF32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MATMUL_TILES = (32, 64, 32)  # BLOCK_M, BLOCK_N, BLOCK_K: fixed, so no row count changes a reduction
QUERY_BLOCK = 16
KEY_BLOCK = 32


def _accumulator(dtype: torch.dtype) -> tl.dtype:
    return tl.float64 if dtype == torch.float64 else tl.float32


def _precision(dtype: torch.dtype) -> str | None:
    """tl.dot's input precision: IEEE for float32 (not TF32, whose rounding is the hardware's choice); half
    precision inputs have no choice to make (None: Triton's default)."""
    return "ieee" if dtype in (torch.float32, torch.float64) else None


@triton.jit
def _matmul_kernel(
    x, w, bias, out, M, N, K,
    sxm, sxk, swn, swk, som, son,
    HAS_BIAS: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)  # [BM]
    cols = tl.program_id(1) * BN + tl.arange(0, BN)  # [BN]
    acc = tl.zeros((BM, BN), dtype=ACC)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)  # [BK]
        a = tl.load(x + rows[:, None] * sxm + ks[None, :] * sxk, mask=(rows[:, None] < M) & (ks[None, :] < K), other=0)
        b = tl.load(w + cols[None, :] * swn + ks[:, None] * swk, mask=(cols[None, :] < N) & (ks[:, None] < K), other=0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION, out_dtype=ACC)  # [BM, BN] += [BM, BK] @ [BK, BN]
    if HAS_BIAS:
        acc += tl.load(bias + cols, mask=cols < N, other=0).to(ACC)[None, :]
    keep = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(out + rows[:, None] * som + cols[None, :] * son, acc.to(out.dtype.element_ty), mask=keep)


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` like ``F.linear``: ``x`` ``[..., K]``, ``weight`` ``[N, K]`` → ``[..., N]``."""
    flat = x.reshape(-1, x.shape[-1])  # [M, K]
    (m, k), n = flat.shape, weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)  # [M, N]
    bm, bn, bk = MATMUL_TILES
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _matmul_kernel[grid](
        flat, weight, weight if bias is None else bias, out, m, n, k,
        flat.stride(0), flat.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, ACC=_accumulator(x.dtype), PRECISION=_precision(x.dtype), BM=bm, BN=bn, BK=bk,
    )
    return out.reshape(*x.shape[:-1], n)


@triton.jit
def _rms_norm_kernel(x, weight, out, H, sx, so, eps, ACC: tl.constexpr, BH: tl.constexpr):
    row = tl.program_id(0)
    squares = tl.zeros((BH,), dtype=ACC)
    for h0 in range(0, H, BH):
        hs = h0 + tl.arange(0, BH)
        v = tl.load(x + row * sx + hs, mask=hs < H, other=0).to(ACC)
        squares += v * v
    scale = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / H + eps)
    for h0 in range(0, H, BH):
        hs = h0 + tl.arange(0, BH)
        v = tl.load(x + row * sx + hs, mask=hs < H, other=0).to(ACC)
        normed = (v * scale).to(out.dtype.element_ty)  # as transformers: normalised, cast, then weighted
        g = tl.load(weight + hs, mask=hs < H, other=0)
        tl.store(out + row * so + hs, g * normed, mask=hs < H)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / sqrt(mean(x**2) + eps))`` over the last dimension ``[..., H]``, one row per program."""
    flat = x.reshape(-1, x.shape[-1]).contiguous()  # [M, H]
    out = torch.empty_like(flat)
    width = min(1024, triton.next_power_of_2(flat.shape[1]))
    _rms_norm_kernel[(flat.shape[0],)](
        flat, weight, out, flat.shape[1], flat.stride(0), out.stride(0), eps, ACC=_accumulator(x.dtype), BH=width
    )
    return out.reshape(x.shape)


@triton.jit
def _attention_kernel(
    q, k, v, visible, pad, out, H, GROUP, Q, L, D, scale,
    sqb, sqh, sqq, skb, skh, skl, svb, svh, svl, smb, smq, sml, sob, soq, soh,
    ACC: tl.constexpr, PRECISION: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
):
    b = tl.program_id(1) // H
    h = tl.program_id(1) % H
    kv = h // GROUP
    queries = tl.program_id(0) * BM + tl.arange(0, BM)  # [BM]
    dims = tl.arange(0, BD)  # [BD]
    in_q, in_d = queries < Q, dims < D
    qt = tl.load(q + b * sqb + h * sqh + queries[:, None] * sqq + dims[None, :], mask=in_q[:, None] & in_d[None, :],
                 other=0)  # [BM, BD]
    top = tl.full((BM,), float("-inf"), dtype=ACC)  # running maximum of the scores (log2 units)
    total = tl.zeros((BM,), dtype=ACC)  # running normaliser
    acc = tl.zeros((BM, BD), dtype=ACC)  # running weighted sum of values
    for start in range(tl.load(pad + b), L, BN):  # key blocks anchored at the row's first real key
        keys = start + tl.arange(0, BN)  # [BN]
        in_k = keys < L
        kt = tl.load(k + b * skb + kv * skh + keys[None, :] * skl + dims[:, None], mask=in_k[None, :] & in_d[:, None],
                     other=0)  # [BD, BN]
        seen = tl.load(visible + b * smb + queries[:, None] * smq + keys[None, :] * sml,
                       mask=in_q[:, None] & in_k[None, :], other=0) != 0  # [BM, BN]
        s = tl.dot(qt, kt, input_precision=PRECISION, out_dtype=ACC) * scale  # [BM, BN]
        s = tl.where(seen, s, float("-inf"))
        new_top = tl.maximum(top, tl.max(s, axis=1))  # [BM]
        anchor = tl.where(new_top == float("-inf"), 0.0, new_top)  # no key seen yet: keep the factors finite
        factor = tl.exp2(top - anchor)  # exactly 1 where the maximum did not move
        p = tl.where(seen, tl.exp2(s - anchor[:, None]), 0.0)  # [BM, BN]
        vt = tl.load(v + b * svb + kv * svh + keys[:, None] * svl + dims[None, :], mask=in_k[:, None] & in_d[None, :],
                     other=0)  # [BN, BD]
        total = total * factor + tl.sum(p, axis=1)
        acc = acc * factor[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PRECISION, out_dtype=ACC)
        top = new_top
    result = acc / tl.where(total == 0, 1.0, total)[:, None]  # a query that sees no key: zeros
    tl.store(out + b * sob + queries[:, None] * soq + h * soh + dims[None, :], result.to(out.dtype.element_ty),
             mask=in_q[:, None] & in_d[None, :])


def attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor, scaling: float
) -> torch.Tensor:
    """``query`` ``[B, H, q, D]``, ``key``/``value`` ``[B, Hk, L, D]`` (``H`` a multiple of ``Hk``, last dimension
    contiguous), ``visible`` boolean ``[B, 1, q, L]``; returns ``[B, q, H, D]`` (as transformers' attention functions
    do). A row's first real key is the first key its last query sees (every real query sees it).

    Worked example of the anchoring (``KEY_BLOCK = 32``): a row padded by 5 in a batch of width 70 reads key blocks
    ``[5, 37)`` and ``[37, 69)`` (then ``[69, 70)``); alone (no padding, width 65) it reads ``[0, 32)``, ``[32, 64)``
    and ``[64, 65)``: the same keys in the same blocks.
    """
    batch, heads, queries, size = query.shape
    keys = key.shape[2]
    pad = visible[:, 0, -1, :].int().argmax(dim=-1).to(torch.int32)  # [B]: first key the last query sees
    out = torch.empty((batch, queries, heads, size), dtype=query.dtype, device=query.device)  # [B, q, H, D]
    mask = visible.to(torch.int8)  # [B, 1, q, L]
    grid = (triton.cdiv(queries, QUERY_BLOCK), batch * heads)
    _attention_kernel[grid](
        query, key, value, mask, pad, out, heads, heads // key.shape[1], queries, keys, size,
        scaling * 1.4426950408889634,  # scores in log2 units: exp2 of them is exp of the natural ones
        query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), mask.stride(0), mask.stride(2), mask.stride(3),
        out.stride(0), out.stride(1), out.stride(2),
        ACC=_accumulator(query.dtype), PRECISION=_precision(query.dtype),
        BM=QUERY_BLOCK, BN=KEY_BLOCK, BD=max(16, triton.next_power_of_2(size)),
    )
    return out
