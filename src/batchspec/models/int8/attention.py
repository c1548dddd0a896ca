"""Attention whose output for one query depends only on that query and the keys and values it sees.

Queries, keys and values are quantized per token and head to integers of 15 bits (:data:`QKV_LEVELS`), held in
float64. For one query ``q`` over its visible keys ``j``:

* ``dot[j] = Q . K[j]`` is an integer below 2**37 (``|Q|, |K| <= 32767``, head size <= 128): the float64 product
  is exact in any order. ``score[j] = (dot[j] * sq) * sk[j] * scaling``, elementwise.
* ``e[j] = exp(score[j] - max score)`` by :func:`~batchspec.models.int8.arithmetic.exp_nonpositive`, 0 where masked.
* The softmax-weighted sum ``sum_j e[j] sv[j] V[j] / sum_j e[j]`` is taken over integers: ``a[j] = e[j] sv[j]`` is
  rounded to ``W[j] = round(a[j] / max a * 2**20)`` and ``e[j]`` to ``E[j] = round(e[j] * 2**20)``; then
  ``sum_j W[j] V[j]`` (below 2**35 per key, so exact for fewer than 2**18 keys) and ``sum_j E[j]`` are exact, and
  ``out = max a * sum_j W[j] V[j] / sum_j E[j]``.

No float sum runs over keys or head channels, so padding (masked keys), the number of queries in the forward and the
batch change nothing. A query with no visible key (a padding position) outputs zeros.

Worked example (one head, D = 1, two visible keys): with ``e = [1, 0.5]``, ``sv = [0.1, 0.2]`` and ``V = [10, -5]``,
``a = [0.1, 0.1]``, ``max a = 0.1``, ``W = [2**20, 2**20]``, ``E = [2**20, 2**19]``; ``sum W V = 5 * 2**20`` and
``out = 0.1 * 5 * 2**20 / (1.5 * 2**20) = 0.333...``, which is ``(1 * 1.0 + 0.5 * (-1.0)) / 1.5``.
"""

from __future__ import annotations

from typing import Any

import torch

from batchspec.models.int8.arithmetic import exp_nonpositive, quantize_rows

NAME = "batchspec_exact"
QKV_LEVELS = 2**15 - 1
WEIGHT_BITS = 20
MAX_KEYS = 2**18  # sum_j W[j] V[j] stays below 2**53 for fewer keys than this
MAX_HEAD_SIZE = 2**16  # sum_d Q[d] K[d] stays below 2**53 for smaller heads than this
QUERY_CHUNK = 256  # queries per block, bounding the score tensor's memory (each query is independent)


def exact_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention function transformers calls for :data:`NAME` (its ``AttentionInterface`` signature).

    ``query`` ``[B, H, q, D]``, ``key``/``value`` ``[B, Hk, L, D]`` (``H`` a multiple of ``Hk``), ``attention_mask``
    boolean ``[B, 1, q, L]`` (True: visible), or None for a causal forward without padding; returns ``[B, q, H, D]``.
    """
    batch, heads, queries, size = query.shape
    keys = key.shape[2]
    if keys >= MAX_KEYS or size >= MAX_HEAD_SIZE:
        raise ValueError(f"exact attention holds up to {MAX_KEYS - 1} keys and heads below {MAX_HEAD_SIZE} values")
    visible = _visible(attention_mask, batch, queries, keys, query.device)  # [B, 1, q, L]
    k, k_scale = _quantized(key)  # [B, Hk, L, D], [B, Hk, L, 1]
    v, v_scale = _quantized(value)
    blocks = []
    for start in range(0, queries, QUERY_CHUNK):
        block = slice(start, start + QUERY_CHUNK)
        blocks.append(_attend(query[:, :, block], k, k_scale, v, v_scale, visible[:, :, block], scaling))
    out = torch.cat(blocks, dim=2)  # [B, H, q, D]
    return out.transpose(1, 2).contiguous().to(query.dtype), None


def _quantized(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, scale = quantize_rows(x, QKV_LEVELS)
    return q.to(torch.float64), scale.to(torch.float64)


def _visible(mask: torch.Tensor | None, batch: int, queries: int, keys: int, device: torch.device) -> torch.Tensor:
    """The boolean visibility ``[B, 1, q, L]``: the mask given, or causal with the queries last."""
    if mask is None:
        columns = torch.arange(keys, device=device)
        rows = torch.arange(keys - queries, keys, device=device)
        return (columns[None, :] <= rows[:, None]).expand(batch, 1, queries, keys)
    if mask.dtype != torch.bool:
        raise TypeError(f"{NAME} attention takes a boolean mask, not {mask.dtype}")
    return mask


def _attend(query, k, k_scale, v, v_scale, visible, scaling: float) -> torch.Tensor:
    """One block of queries: ``query`` ``[B, H, c, D]``, ``visible`` ``[B, 1, c, L]`` -> ``[B, H, c, D]`` float64."""
    batch, heads, count, size = query.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    group = heads // kv_heads
    q, q_scale = _quantized(query)
    q = q.reshape(batch, kv_heads, group * count, size)  # [B, Hk, G*c, D]: head h = kv * G + g
    dots = q @ k.transpose(-1, -2)  # [B, Hk, G*c, L], exact integers
    scores = dots * q_scale.reshape(batch, kv_heads, group * count, 1) * k_scale.transpose(-1, -2) * scaling
    seen = visible[:, :, None].expand(batch, 1, group, count, keys).reshape(batch, 1, group * count, keys)
    scores = scores.masked_fill(~seen, float("-inf"))
    top = scores.amax(-1, keepdim=True)  # [B, Hk, G*c, 1]
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    e = torch.where(seen, exp_nonpositive(scores - top), torch.zeros_like(scores))  # [B, Hk, G*c, L]
    a = e * v_scale.transpose(-1, -2)  # [B, Hk, G*c, L]
    a_top = a.amax(-1, keepdim=True)
    unit = float(2**WEIGHT_BITS)
    weights = torch.round(a / torch.where(a_top > 0, a_top, torch.ones_like(a_top)) * unit)
    total = torch.round(e * unit).sum(-1, keepdim=True)  # exact: integers below 2**53
    out = (weights @ v) * a_top  # [B, Hk, G*c, D]
    out = torch.where(total > 0, out / torch.where(total > 0, total, torch.ones_like(total)), torch.zeros_like(out))
    return out.reshape(batch, heads, count, size)


def mask_function(*args: Any, **kwargs: Any):
    """The mask transformers builds for :data:`NAME` in its own forwards: sdpa's boolean 4D mask, never skipped."""
    from transformers.masking_utils import sdpa_mask

    kwargs.pop("allow_is_causal_skip", None)
    return sdpa_mask(*args, allow_is_causal_skip=False, **kwargs)


def register() -> None:
    """Make :data:`NAME` an attention implementation transformers knows (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, exact_attention)
    AttentionMaskInterface.register(NAME, mask_function)
