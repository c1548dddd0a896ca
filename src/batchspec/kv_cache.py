"""A batched KV cache that the engine can realign in one vectorised gather.

Storage is one tensor per model, ``[num_layers, 2, B, H_kv, capacity, D]`` (index 0 keys, 1 values), with
every row right-aligned like the token matrix: column ``j`` of the cache holds the KV of column ``j`` of
``BatchState.tokens``. Appending writes in place into the spare capacity; realignment (rows shifting by
``delta``, finished rows leaving) is a single ``gather`` over all layers at once, never a per-row rebuild.

``BatchKVCache`` plugs into transformers 5.x through its ``Cache``/``CacheLayerMixin`` API: each layer's
``update`` writes the new keys/values and returns views of the filled prefix.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from batchspec.realign import RealignPlan

_GROWTH = 256


class _StoreLayer(CacheLayerMixin):
    """One decoder layer's view into the shared storage."""

    is_sliding = False
    is_compileable = False

    def __init__(self, owner: BatchKVCache, layer_idx: int) -> None:
        self.owner = owner
        self.layer_idx = layer_idx
        self.length = 0
        self.is_initialized = True

    @property
    def keys(self) -> torch.Tensor | None:  # [B, H, length, D]
        store = self.owner.storage
        return None if store is None else store[self.layer_idx, 0, :, :, : self.length]

    @property
    def values(self) -> torch.Tensor | None:  # [B, H, length, D]
        store = self.owner.storage
        return None if store is None else store[self.layer_idx, 1, :, :, : self.length]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.owner.allocate_like(key_states)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states, value_states: [B, H, q, D]
        start, end = self.length, self.length + key_states.shape[-2]
        store = self.owner.ensure_capacity(key_states, end)
        store[self.layer_idx, 0, :, :, start:end] = key_states
        store[self.layer_idx, 1, :, :, start:end] = value_states
        self.length = end
        return store[self.layer_idx, 0, :, :, :end], store[self.layer_idx, 1, :, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1


class BatchKVCache(Cache):
    """KV cache of one model for one batch; every layer holds the same number of columns between forwards."""

    def __init__(self, num_layers: int) -> None:
        self.storage: torch.Tensor | None = None  # [num_layers, 2, B, H, capacity, D]
        super().__init__(layers=[_StoreLayer(self, i) for i in range(num_layers)])

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> BatchKVCache:
        return cls(model.config.get_text_config().num_hidden_layers)

    @property
    def length(self) -> int:
        """Columns held by every layer."""
        return self.layers[0].length

    def allocate_like(self, key_states: torch.Tensor) -> torch.Tensor:
        batch, heads, _, dim = key_states.shape
        self.storage = key_states.new_zeros((len(self.layers), 2, batch, heads, _GROWTH, dim))
        return self.storage

    def ensure_capacity(self, key_states: torch.Tensor, needed: int) -> torch.Tensor:
        """Storage with room for ``needed`` columns; grows (one copy) when full."""
        store = self.storage if self.storage is not None else self.allocate_like(key_states)
        if store.shape[4] < needed:
            grown = store.new_zeros((*store.shape[:4], needed + _GROWTH, store.shape[5]))
            grown[:, :, :, :, : store.shape[4]] = store
            self.storage = store = grown
        return store

    def set_length(self, length: int) -> None:
        for layer in self.layers:
            layer.length = length

    def realign(self, plan: RealignPlan, length: int) -> None:
        """Move every kept row by its shift and keep ``length`` columns; rows not in the plan are dropped.

        New column ``j`` of kept row ``b`` reads old column ``plan.source_columns(length)[b, j]`` of old row
        ``plan.rows[b]``; all layers, keys and values move in the same gather.
        """
        old = self.length
        if plan.identity or self.storage is None:
            self.set_length(min(length, old))
            return
        store = self.storage[:, :, :, :, :old]  # [N, 2, B, H, old, D]
        if plan.size != store.shape[2]:
            store = store.index_select(2, plan.rows)  # [N, 2, B', H, old, D]
        n, two, rows, heads, _, dim = store.shape
        cols = plan.source_columns(length).clamp(max=max(old - 1, 0))  # [B', length]
        index = cols[None, None, :, None, :, None].expand(n, two, rows, heads, length, dim)
        fresh = store.new_empty((n, two, rows, heads, max(self.storage.shape[4], length + _GROWTH), dim))
        torch.gather(store, 4, index, out=fresh[:, :, :, :, :length])
        self.storage = fresh
        self.set_length(length)
