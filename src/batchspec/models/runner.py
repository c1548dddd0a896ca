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
    start = cache.length
    end = start + input_ids.shape[1]
    out = model(
        input_ids=input_ids,
        attention_mask=batch.attention_mask(end),
        position_ids=batch.position_ids(start, end),
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=logits_to_keep,
    )
    return out.logits
