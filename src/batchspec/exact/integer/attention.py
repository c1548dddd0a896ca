"""Attention whose output for one query depends only on that query and the keys and values it sees.

Queries, keys and values are quantized per token and head to integers of 15 bits (:data:`QKV_LEVELS`), held in
float64. For one query ``q`` over its visible keys ``j``:

* ``dot[j] = Q . K[j]`` is an integer below 2**37 (``|Q|, |K| <= 32767``, head size <= 128): the float64 product
  is exact in any order. ``score[j] = (dot[j] * sq) * sk[j] * scaling``, elementwise.
* With a soft-cap ``c`` (Gemma 2's), ``score[j] = c tanh(score[j] / c)``
  (:func:`~batchspec.exact.integer.arithmetic.exact_softcap`, elementwise).
* ``e[j] = exp(score[j] - max score)`` by :func:`~batchspec.exact.integer.arithmetic.exp2_nonpositive` (in float32,
  the scores in units of log2), 0 where masked.
* The softmax-weighted sum ``sum_j e[j] sv[j] V[j] / sum_j e[j]`` is taken over integers: ``a[j] = e[j] sv[j]`` is
  rounded to ``W[j] = round(a[j] / max a * 2**20)`` and ``e[j]`` to ``E[j] = round(e[j] * 2**20)``; then
  ``sum_j W[j] V[j]`` (below 2**35 per key, so exact for fewer than 2**18 keys) and ``sum_j E[j]`` are exact, and
  ``out = max a * sum_j W[j] V[j] / sum_j E[j]``.

No float sum runs over keys or head channels, so padding (masked keys), the number of queries in the forward and the
batch change nothing. A query with no visible key (a padding position) outputs zeros. A token holding an inf or a NaN
is quantized to scale NaN and integers 0 (:func:`~batchspec.exact.integer.arithmetic.quantize_rows`); a query that
sees a key whose score is not finite (that key or the query itself so quantized, or a score beyond float32) or a
value whose scale is NaN outputs NaN in every channel, on every build, and keys and values it does not see change
nothing.

Keys and values are quantized once, when they enter the KV cache: :func:`pack_on_update` hands the attention module a
cache whose ``update`` stores them *packed* as int16 (:func:`pack`), so a decoding step does not quantize the whole
cache again in every layer. A token's head is its integers alone, 2 bytes a value where float32 keys take 4: the
scale's 32 bits (a float32) are the parities of its first :data:`SCALE_BITS` integers, each of those rounded to the
neighbour of ``x / scale`` whose parity is the bit (within 1 of it, where the others are within 1/2).

Worked example (one head, D = 1, two visible keys): with ``e = [1, 0.5]``, ``sv = [0.1, 0.2]`` and ``V = [10, -5]``,
``a = [0.1, 0.1]``, ``max a = 0.1``, ``W = [2**20, 2**20]``, ``E = [2**20, 2**19]``; ``sum W V = 5 * 2**20`` and
``out = 0.1 * 5 * 2**20 / (1.5 * 2**20) = 0.333...``, which is ``(1 * 1.0 + 0.5 * (-1.0)) / 1.5``.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.nn.functional as F

from batchspec.exact.integer import native
from batchspec.exact.integer.arithmetic import EXP2_COEFFICIENTS, exact_softcap, exp2_nonpositive, quantize_rows
from batchspec.exact.integer.native import SCALE_BITS, packed_width
from batchspec.exact.swap import register_attention

logger = logging.getLogger(__name__)

NAME = "batchspec_exact"
QKV_LEVELS = 2**15 - 1
WEIGHT_BITS = 20
MAX_KEYS = 2**18  # sum_j W[j] V[j] stays below 2**53 for fewer keys than this
MAX_HEAD_SIZE = 2**16  # sum_d Q[d] K[d] stays below 2**53 for smaller heads than this
QUERY_CHUNK = 64  # queries per block: bounds the scores' memory and skips keys a causal block cannot see


def exact_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor, scaling: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """The attention kernel of :data:`NAME` (see :mod:`batchspec.exact.swap`): ``query`` ``[B, H, q, D]``,
    ``key``/``value`` ``[B, Hk, L, W]`` packed as :func:`pack` stores them, or raw ``[B, Hk, L, D]`` (``H`` a
    multiple of ``Hk``), ``visible`` boolean ``[B, 1, q, L]``, the scores soft-capped at ``softcap`` where it is
    set (Gemma 2's ``attn_logit_softcapping``: :func:`~batchspec.exact.integer.arithmetic.exact_softcap`, after the
    scaling and before the softmax); returns ``[B, q, H, D]``.

    Queries go in blocks of :data:`QUERY_CHUNK`, each over the keys it can see: to batchspec's native kernel where
    the CPU runs it and the cache is packed, else to torch's batched float64 products (the same bits)."""
    batch, heads, queries, size = query.shape
    keys = key.shape[2]
    if keys >= MAX_KEYS or size >= MAX_HEAD_SIZE:
        raise ValueError(f"exact attention holds up to {MAX_KEYS - 1} keys and heads below {MAX_HEAD_SIZE} values")
    blocks = [(slice(start, start + QUERY_CHUNK), slice(0, keys - queries + min(queries, start + QUERY_CHUNK)))
              for start in range(0, queries, QUERY_CHUNK)]  # (queries, the keys a causal block can see)
    if native.available():
        parts = [(query, key, value, visible)] if queries <= QUERY_CHUNK else [  # one block sees every key
            (query[:, :, block], key[:, :, seen], value[:, :, seen], visible[:, :, block, seen])
            for block, seen in blocks]
        out = [native.attention(*part, scaling, QKV_LEVELS, EXP2_COEFFICIENTS, softcap) for part in parts]
        if all(part is not None for part in out):
            return out[0] if len(out) == 1 else torch.cat(out, dim=1)  # [B, q, H, D]
        _say_once(f"batchspec: exact attention over heads of {size} values runs in torch (the native kernel takes "
                  f"heads of up to {native.MAX_HEAD_SIZE} values and keys packed in the int16 cache)")
    k, k_scale = _unpacked(key, size)  # [B, Hk, L, D], [B, Hk, L, 1]
    v, v_scale = _unpacked(value, size)
    out = [_attend(query[:, :, block], k[:, :, seen], k_scale[:, :, seen], v[:, :, seen], v_scale[:, :, seen],
                   visible[:, :, block, seen], scaling, softcap) for block, seen in blocks]
    out = out[0] if len(out) == 1 else torch.cat(out, dim=2)  # [B, H, q, D]
    return out.transpose(1, 2).to(query.dtype, memory_format=torch.contiguous_format)  # [B, q, H, D]


def _say_once(message: str) -> None:
    """Log ``message`` the first time it comes."""
    if message not in _SAID:
        _SAID.add(message)
        logger.info(message)


_SAID: set[str] = set()


def _quantized(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dtype == torch.float32 and native.available():
        return native.quantize_wide(x, QKV_LEVELS)
    q, scale = quantize_rows(x, QKV_LEVELS)
    return q.to(torch.float64), scale.to(torch.float64)


def pack(x: torch.Tensor) -> torch.Tensor:
    """Keys or values ``[B, Hk, q, D]`` quantized per token and head in float32: ``[B, Hk, q, W]`` int16 (``W`` =
    :func:`packed_width`), the integers ``r = clamp(round(x / s), +-32767)`` of
    :func:`~batchspec.exact.integer.arithmetic.quantize_rows` (and ``x = 0`` past ``D``), except that integer ``i <``
    :data:`SCALE_BITS` whose parity is not bit ``i`` of the scale ``s`` moves one step towards ``x / s`` (away from
    it where ``x / s`` is ``r`` itself, back inside ``+-32767`` at the edge). A token holding an inf or a NaN has
    ``s`` NaN and ``r`` 0, ``x / s`` taken as 0: its integers are the 1s of the NaN's bits among zeros.

    Example: the head ``[0.5, -1.0, 0.25]`` has ``s`` the float32 of ``1 / 32767``, bits 8, 27, 28 and 29 set, and
    ``x / s = [16383.5, -32767, 8191.75]``; rounding gives ``[16384, -32767, 8192]``, whose parities are bits 0-2 but
    for the odd ``-32767``, which becomes ``-32766``. Past ``D`` the integers are 0, and 1 at bits 8 and 27-29:
    ``[16384, -32766, 8192, 0, 0, 0, 0, 0, 1, 0, ..., 0, 1, 1, 1, 0, 0]`` (32 int16)."""
    width = packed_width(x.shape[-1])
    if x.dtype == torch.float32 and native.available():
        return native.pack_kv(x, QKV_LEVELS, width)
    x = F.pad(x.float(), (0, width - x.shape[-1]))  # [..., W]
    rounded, scale = quantize_rows(x, QKV_LEVELS)  # [..., W], [..., 1] float32
    t = (x[..., :SCALE_BITS] * (1.0 / scale)).masked_fill_(scale.isnan(), 0.0)  # [..., 32]: the carriers unrounded
    r = rounded[..., :SCALE_BITS]
    bits = scale.view(torch.int32).bitwise_right_shift(_bit_places(torch.int32)).bitwise_and_(1)  # [..., 32]
    step = torch.where(t >= r, 1.0, -1.0)
    moved = torch.where((r + step).abs() > QKV_LEVELS, r - step, r + step)
    odd = r.to(torch.int32).bitwise_and_(1)
    rounded[..., :SCALE_BITS] = torch.where(odd == bits, r, moved)
    return rounded.to(torch.int16)


def _unpacked(x: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(integers [..., D], scale [..., 1])`` in float64 of packed keys or values; raw ones (no cache) are quantized
    here."""
    if x.dtype != torch.int16:
        return _quantized(x)
    bits = x[..., :SCALE_BITS].to(torch.int64).bitwise_and_(1).bitwise_left_shift_(_bit_places(torch.int64))
    word = bits.sum(-1, keepdim=True)  # [..., 1]: the scale's bits as an unsigned 32-bit integer (distinct powers)
    scale = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32).view(torch.float32)
    return x[..., :size].to(torch.float64), scale.to(torch.float64)


def _bit_places(dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(SCALE_BITS, dtype=dtype)  # [32]


class _PackingCache:
    """A KV cache as the attention module sees it: ``update`` stores packed keys and values (see :func:`pack`)."""

    def __init__(self, cache: Any) -> None:
        self._cache = cache

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        return self._cache.update(pack(key_states), pack(value_states), *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)


def pack_on_update(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook of an attention module: its cache argument (``cache``, or ``past_key_values`` in
    transformers versions before the rename) becomes a :class:`_PackingCache`."""
    for name in ("cache", "past_key_values"):
        if kwargs.get(name) is not None:
            kwargs = {**kwargs, name: _PackingCache(kwargs[name])}
    return args, kwargs


def _attend(query, k, k_scale, v, v_scale, visible, scaling: float, softcap: float | None) -> torch.Tensor:
    """One block of queries: ``query`` ``[B, H, c, D]``, ``visible`` ``[B, 1, c, L]`` -> ``[B, H, c, D]`` float64.

    Scores are kept in float32 and in units of log2 (the softmax's own ``exp`` becomes ``2**t``); the sums over
    keys are the exact integer products of the module docstring; with ``softcap`` the scores are capped at it (in
    log2 units, at ``softcap / ln 2``) once their rows are marked broken. A query that sees a score that is not
    finite or a value whose scale is NaN is NaN (the module docstring).
    """
    batch, heads, count, size = query.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    group = heads // kv_heads
    q, q_scale = _quantized(query)
    q = q.reshape(batch, kv_heads, group * count, size)  # [B, Hk, G*c, D]: head h = kv * G + g
    dots = q @ k.transpose(-1, -2)  # [B, Hk, G*c, L], exact integers
    factor = q_scale.reshape(batch, kv_heads, group * count, 1) * (scaling / math.log(2.0))  # [B, Hk, G*c, 1]
    scores = dots.mul_(factor).mul_(k_scale.transpose(-1, -2)).to(torch.float32)  # [B, Hk, G*c, L], log2 units
    hidden = ~visible[:, :, None].expand(batch, 1, group, count, keys).reshape(batch, 1, group * count, keys)
    v_scale = v_scale.transpose(-1, -2).to(torch.float32)  # [B, Hk, 1, L]
    usable = v_scale.isfinite()  # [B, Hk, 1, L]
    broken = (~scores.isfinite()).logical_or_(~usable).logical_and_(~hidden).any(-1, keepdim=True)  # [B, Hk, G*c, 1]
    v_scale = torch.where(usable, v_scale, 0.0)  # a value it does not see weighs 0 whatever its scale (e = 0 there)
    if softcap:
        scores = exact_softcap(scores, softcap / math.log(2.0))  # [B, Hk, G*c, L]
    scores.masked_fill_(hidden, float("-inf"))
    top = scores.amax(-1, keepdim=True)  # [B, Hk, G*c, 1]
    top = top.nan_to_num_(neginf=0.0)  # a query that sees no key: -inf -> 0
    e = exp2_nonpositive(scores.sub_(top)).masked_fill_(hidden, 0.0)  # [B, Hk, G*c, L]
    a = e * v_scale  # [B, Hk, G*c, L]
    a_top = a.amax(-1, keepdim=True)  # [B, Hk, G*c, 1]
    unit = float(2**WEIGHT_BITS)
    weights = a.div_(torch.where(a_top > 0, a_top, 1.0)).mul_(unit).round_()
    total = e.mul_(unit).round_().sum(-1, keepdim=True, dtype=torch.float64)  # exact: integers below 2**53
    out = (weights.to(torch.float64) @ v).mul_(a_top.to(torch.float64))  # [B, Hk, G*c, D]
    out = out.div_(total.clamp(min=1.0))  # a query that sees no key: zero weights, so zeros
    out.masked_fill_(broken, math.nan)  # [B, Hk, G*c, D]: a query that sees a value or a score that is not finite
    return out.reshape(batch, heads, count, size)


def register() -> None:
    """Make :data:`NAME` an attention implementation transformers knows (idempotent)."""
    register_attention(NAME, exact_attention)
