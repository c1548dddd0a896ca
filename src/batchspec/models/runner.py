"""One model, one batch: forwards over columns of the padded layout, with the batch's KV cache."""

from __future__ import annotations

import torch

from batchspec.kv_cache import BatchKVCache
from batchspec.state import BatchState


class ModelRunner:
    """Runs a causal LM on a :class:`BatchState`, deriving the attention mask and position ids from the
    batch's pad lengths (I1/I2), never from token values."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.cache = BatchKVCache.for_model(model)

    def forward(self, batch: BatchState, input_ids: torch.Tensor, *, logits_to_keep: int) -> torch.Tensor:
        """Feed ``input_ids`` ``[B, q]`` as the columns right after the cached ones.

        Columns at or past the batch width (drafted tokens) count as real. Returns the logits of the last
        ``logits_to_keep`` inputs, ``[B, logits_to_keep, V]``.
        """
        start = self.cache.length
        end = start + input_ids.shape[1]
        out = self.model(
            input_ids=input_ids,
            attention_mask=batch.attention_mask(end),
            position_ids=batch.position_ids(start, end),
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=logits_to_keep,
        )
        return out.logits
