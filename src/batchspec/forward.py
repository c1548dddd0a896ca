"""One model forward over columns of a batch's padded layout, writing into one of the batch's KV caches."""

from __future__ import annotations

import torch

from batchspec.kv_cache import BatchKVCache
from batchspec.state import BatchState


def forward_columns(
    model: torch.nn.Module,
    batch: BatchState,
    cache: BatchKVCache,
    input_ids: torch.Tensor,
    *,
    logits_to_keep: int,
) -> torch.Tensor:
    """Feed ``input_ids`` ``[B, q]`` as the columns right after the ones ``cache`` holds.

    The attention mask and position ids come from the batch's pad lengths (I1/I2), never from token values;
    columns at or past the batch width (drafted tokens) count as real. Returns the logits of the last
    ``logits_to_keep`` inputs, ``[B, logits_to_keep, V]``.
    """
    out = model(**_inputs(batch, cache, input_ids), logits_to_keep=logits_to_keep)
    return out.logits


def read_columns(model: torch.nn.Module, batch: BatchState, cache: BatchKVCache, input_ids: torch.Tensor) -> None:
    """Feed ``input_ids`` ``[B, q]`` like :func:`forward_columns` for their KV only: the decoder runs, the output
    layer (``[B, q, V]`` logits, the largest matrix product of a prefill) does not."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is None:
        forward_columns(model, batch, cache, input_ids, logits_to_keep=1)
        return
    decoder(**_inputs(batch, cache, input_ids))


def _inputs(batch: BatchState, cache: BatchKVCache, input_ids: torch.Tensor) -> dict:
    start = cache.length
    end = start + input_ids.shape[1]
    return dict(
        input_ids=input_ids,
        attention_mask=batch.attention_mask(end),
        position_ids=batch.position_ids(start, end),
        past_key_values=cache,
        use_cache=True,
    )
