"""KV storage of one batch: a token matrix and one tensor per model that transformers writes into in place.

Storage of a model is ``[num_layers, 2, B, H_kv, capacity, D]`` (index 0 keys, 1 values) with every row laid
out like the batch's token matrix: cache column ``j`` holds the KV of token column ``j``. A forward appends
into the spare capacity; moving rows to another layout is a gather done by :mod:`batchspec.engine.realign`.

``BatchKVCache`` plugs into transformers 5.x through its ``Cache``/``CacheLayerMixin`` API: each layer's
``update`` writes the new keys/values and returns views of the filled prefix. In *static* mode
(:meth:`BatchKVCache.writing_at`, the shape CUDA graphs need: :mod:`batchspec.engine.graphs`) it writes at columns held
in a device tensor and returns the whole capacity, so a forward's shapes and addresses do not depend on the length.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from batchspec.engine.errors import InvariantError

GROWTH = 256


class _StoreLayer(CacheLayerMixin):
    """One decoder layer's view into the shared storage."""

    is_sliding = False
    is_compileable = False

    def __init__(self, owner: BatchKVCache, layer_idx: int) -> None:
        self._owner = weakref.ref(owner)  # weak: a cycle would keep the storage alive until Python's cyclic GC
        self.layer_idx = layer_idx
        self.is_initialized = True

    @property
    def owner(self) -> BatchKVCache:
        owner = self._owner()
        if owner is None:
            raise InvariantError("a cache layer outlived its cache")
        return owner

    @property
    def keys(self) -> torch.Tensor | None:  # [B, H, length, D]
        store = self.owner.storage
        return None if store is None else store[self.layer_idx, 0, :, :, : self.owner.length]

    @property
    def values(self) -> torch.Tensor | None:  # [B, H, length, D]
        store = self.owner.storage
        return None if store is None else store[self.layer_idx, 1, :, :, : self.owner.length]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.owner.ensure_capacity(key_states, key_states.shape[-2])

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states, value_states: [B, H, q, D]; every layer writes columns length .. length+q-1
        columns = self.owner.write_at  # [q] in static mode
        if columns is not None:
            store = self.owner.storage
            store[self.layer_idx, 0].index_copy_(2, columns, key_states)
            store[self.layer_idx, 1].index_copy_(2, columns, value_states)
            return store[self.layer_idx, 0], store[self.layer_idx, 1]  # [B, H, capacity, D]
        start = self.owner.length
        end = start + key_states.shape[-2]
        store = self.owner.ensure_capacity(key_states, end)
        store[self.layer_idx, 0, :, :, start:end] = key_states
        store[self.layer_idx, 1, :, :, start:end] = value_states
        if self.layer_idx == len(self.owner.layers) - 1:
            self.owner.length = end
        return store[self.layer_idx, 0, :, :, :end], store[self.layer_idx, 1, :, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.length

    def get_max_length(self) -> int:
        return -1


class BatchKVCache(Cache):
    """KV cache of one model for one batch; every layer holds ``length`` columns between forwards."""

    def __init__(self, num_layers: int, storage: torch.Tensor | None = None, length: int = 0,
                 whole: torch.Tensor | None = None) -> None:
        self.storage = storage  # [num_layers, 2, B, H, capacity, D]
        self.whole = storage if whole is None else whole  # [num_layers, 2, rows, H, capacity, D]: storage = its first B
        self.length = length
        self.write_at: torch.Tensor | None = None  # [q] the columns a static-mode forward writes
        super().__init__(layers=[_StoreLayer(self, i) for i in range(num_layers)])

    @contextmanager
    def writing_at(self, columns: torch.Tensor) -> Iterator[None]:
        """Static mode for one forward: every layer writes its keys and values at ``columns`` ``[q]`` (a device
        tensor) and attends over the whole capacity; the caller masks what lies past the length, and advances
        ``length`` itself. The storage must already hold the columns (:meth:`ensure_capacity`)."""
        if self.storage is None:
            raise InvariantError("static mode needs allocated storage")
        self.write_at = columns
        try:
            yield
        finally:
            self.write_at = None

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> BatchKVCache:
        return cls(model.config.get_text_config().num_hidden_layers)

    def ensure_capacity(self, key_states: torch.Tensor, needed: int) -> torch.Tensor:
        """Storage with room for ``needed`` columns; allocated on first use, grown (one copy) when full."""
        if self.storage is None:
            batch, heads, _, dim = key_states.shape
            self.storage = self.whole = key_states.new_zeros((len(self.layers), 2, batch, heads, needed + GROWTH, dim))
        elif self.storage.shape[4] < needed:
            grown = self.storage.new_zeros((*self.storage.shape[:4], needed + GROWTH, self.storage.shape[5]))
            grown[..., : self.storage.shape[4], :] = self.storage
            self.storage = self.whole = grown
        return self.storage

    def crop(self, length: int) -> None:
        """Forget every column from ``length`` on (rejected drafts); the storage is kept for reuse."""
        self.length = min(self.length, length)


@dataclass
class Slab:
    """Where the rows of one batch keep their tokens and KV between rounds.

    Attributes:
        tokens: ``[B, C]`` token ids in the batch's column layout (padding columns hold a filler value).
        target: the target model's KV cache of these rows.
        draft: the draft model's KV cache of these rows (None without a draft model).
        shared: its caches belong to the prefix cache (:mod:`batchspec.engine.prefix_cache`): rows laid out from it
            are always copied out, never run or shifted in place.
        holders: the sequences laid out in it, in its rows' order; those that still keep their KV here are the rows
            a realignment must not overwrite (:mod:`batchspec.engine.realign`).
    """

    tokens: torch.Tensor  # [B, C]
    target: BatchKVCache
    draft: BatchKVCache | None
    shared: bool = False
    holders: tuple = ()

    @property
    def size(self) -> int:
        return self.tokens.shape[0]
