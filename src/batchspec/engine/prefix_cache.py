"""Prefix reuse: the keys and values of prompts already read, kept for later prompts that start the same way.

With the int8 forward a row's keys and values are the same bits however its tokens were split into forwards and
whatever shared the batch (the property :mod:`tests.test_int8` checks), so a prefix's cached KV *is* what reading
it again would compute, and reusing it changes nothing but the time. (In float32 a batched read rounds differently
from a single-row one, so a reused prefix equals a recomputed one only up to that rounding.)

Terms:
    block: :data:`BLOCK` consecutive prompt tokens; prefixes are cached and matched in whole blocks.
    namespace: who may share entries (the server: one API key and ``cache_salt``); it seeds the block hashes, so
        prompts of two namespaces never match.
    key of block ``j``: a hash of the namespace and every token up to the end of block ``j`` (a chain: block ``j``'s
        key hashes block ``j - 1``'s key and block ``j``'s tokens), so equal keys mean equal prefixes (checked on
        the tokens too).
    entry: one prompt's block-aligned prefix with both models' KV for it (one-row storage of its own); it answers
        for every key of its blocks.

On admission a row takes the longest cached prefix of its prompt (:meth:`PrefixCache.link`): its KV location points
at a one-row slab holding its whole prompt and the entry's caches, as if it had read that many columns, and the
engine reads only the rest (the realignment that lays the row out copies the KV into the batch; a shared slab is
never reused in place). Once a row's prompt is read, :meth:`PrefixCache.keep` copies its block-aligned prefix into
an entry. Entries are evicted least recently used first to stay within the byte budget; a row that is still
linked to an evicted entry keeps its storage alive until it is laid out.

Worked example (``BLOCK = 4``): prompt ``A`` of 10 tokens is read and kept as an entry of 8 tokens (2 blocks;
the rest is shorter than a block). Prompt ``B`` of 13 tokens shares ``A``'s first 6 tokens: its key of block 1
matches, block 2's does not, so it links 4 columns and reads 8. Prompt ``C`` equal to ``A`` links 8 columns, and
reads only its 9th token (the 10th is pending: no row holds its pending token's KV).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from batchspec.config import AUTO
from batchspec.engine.kv_cache import BatchKVCache, Slab
from batchspec.engine.state import KVLocation, Sequence
from batchspec.memory import available_bytes

BLOCK = 16
AUTO_SHARE = 0.25  # of the device's free memory, for "auto"
AUTO_MAX = 4 << 30
WAIT_SHARE = 0.25  # a new row waits for another's prompt when they share this much of what it would read ...
WAIT_TOKENS = 256  # ... or this many tokens


@dataclass
class Entry:
    """A cached prefix: ``tokens`` (whole blocks) and a one-row ``slab`` holding their target KV and
    ``draft_columns`` of their draft KV."""

    namespace: str
    tokens: tuple[int, ...]
    slab: Slab
    draft_columns: int
    bytes: int


@dataclass
class PrefixStats:
    """Lookups (new rows), hits (rows that linked a prefix), tokens reused, bytes held and entries evicted."""

    lookups: int = 0
    hits: int = 0
    tokens_reused: int = 0
    bytes_held: int = 0
    evicted: int = 0


@dataclass
class PrefixCache:
    """Entries within ``capacity`` bytes, indexed by block key."""

    capacity: int
    stats: PrefixStats = field(default_factory=PrefixStats)
    _entries: OrderedDict[int, Entry] = field(default_factory=OrderedDict)  # id → entry, least recent first
    _index: dict[int, dict[int, Entry]] = field(default_factory=dict)  # block key → entries holding that prefix

    def link(self, row: Sequence) -> int:
        """Point a new row (no output, no KV but what an earlier link gave it) at the longest cached prefix of its
        prompt; the columns it reuses (0 when it found none longer than it had)."""
        if row.output or (row.kv is not None and not row.kv.slab.shared):
            return 0
        if row.kv is None:
            self.stats.lookups += 1
        found, blocks = None, 0
        for j, key in enumerate(block_keys(row.prefix_namespace, row.prompt), start=1):
            entry = next(iter(self._index.get(key, {}).values()), None)
            if entry is None:
                break
            found, blocks = entry, j
        columns = min(blocks * BLOCK, len(row.prompt) - 1)  # the pending token has no KV
        if found is None or columns <= row.cached_tokens:
            return 0
        if tuple(row.prompt[: blocks * BLOCK]) != found.tokens[: blocks * BLOCK]:
            return 0  # a hash collision
        self._entries.move_to_end(id(found))
        tokens = torch.tensor([row.prompt], dtype=torch.long, device=found.slab.tokens.device)  # [1, P]
        slab = Slab(tokens, found.slab.target, found.slab.draft, shared=True)
        row.kv = KVLocation(slab, 0, start=0, target_cached=columns, draft_cached=min(found.draft_columns, columns))
        self.stats.hits += row.cached_tokens == 0
        self.stats.tokens_reused += columns - row.cached_tokens
        row.cached_tokens = columns
        return columns

    def followers(self, rows: list[Sequence]) -> set[int]:
        """Indices of ``rows`` (rows whose prompts are to be read) that wait for an earlier one: they share blocks
        that neither has in the cache, so once the earlier row's prompt is read and kept, they link it instead of
        reading the same columns. A row waits only where that saves much (:func:`worth_waiting`): it starts a round
        later than the row it waits for, and a batch whose rows are out of step costs realignments.

        Example: eight prompts that open with one 1,500-token system prompt and nothing cached: the first reads,
        seven follow. Eight 800-token articles behind a 32-token chat template: all read at once."""
        leaders: dict[int, list[int]] = {}  # key of a leader's first uncached block → the leader's keys
        waiting = set()
        reading = [i for i, row in enumerate(rows) if row.kv is not None and not row.kv.slab.shared]
        for i in reading + [i for i in range(len(rows)) if i not in set(reading)]:
            row = rows[i]
            keys = block_keys(row.prefix_namespace, row.prompt[: len(row.prompt) - 1])
            blocks = row.cached_tokens // BLOCK
            if blocks >= len(keys) or row.output:
                continue
            leader = leaders.setdefault(keys[blocks], keys)
            if leader is not keys and i not in reading and worth_waiting(keys, leader, blocks, len(row.prompt)):
                waiting.add(i)
        return waiting

    def keep(self, row: Sequence) -> None:
        """Store the block-aligned prefix of a row whose prompt was just read (no output yet), unless the cache
        holds it already."""
        kv = row.kv
        blocks = min(kv.target_cached, len(row.prompt) - 1) // BLOCK if kv is not None and not row.output else 0
        if blocks == 0:
            return
        keys = block_keys(row.prefix_namespace, row.prompt[: blocks * BLOCK])
        if self._index.get(keys[-1]):
            self._entries.move_to_end(id(next(iter(self._index[keys[-1]].values()))))
            return
        columns = blocks * BLOCK
        target = _copy_columns(kv.slab.target, kv.row, kv.start, columns)
        draft_columns = min(kv.draft_cached, columns) if kv.slab.draft is not None else 0
        draft = _copy_columns(kv.slab.draft, kv.row, kv.start, draft_columns) if draft_columns else None
        size = sum(c.storage.numel() * c.storage.element_size() for c in (target, draft) if c is not None)
        if size > self.capacity:
            return
        tokens = tuple(row.prompt[:columns])
        slab = Slab(torch.tensor([tokens], dtype=torch.long, device=kv.slab.tokens.device), target, draft)
        entry = Entry(row.prefix_namespace, tokens, slab, draft_columns, size)
        self._entries[id(entry)] = entry
        for key in keys:
            self._index.setdefault(key, {})[id(entry)] = entry
        self.stats.bytes_held += size
        self._evict()

    def _evict(self) -> None:
        """Drop least recently used entries until the cache holds at most ``capacity`` bytes."""
        while self.stats.bytes_held > self.capacity and self._entries:
            _, entry = self._entries.popitem(last=False)
            for key in block_keys(entry.namespace, entry.tokens):
                holders = self._index.get(key, {})
                holders.pop(id(entry), None)
                if not holders:
                    self._index.pop(key, None)
            self.stats.bytes_held -= entry.bytes
            self.stats.evicted += 1


def worth_waiting(keys: list[int], leader: list[int], start: int, prompt: int) -> bool:
    """Whether a row with block ``keys`` that holds ``start`` blocks should wait for the ``leader``'s prompt: the blocks
    they share from there are at least :data:`WAIT_SHARE` of what the row would read, or :data:`WAIT_TOKENS`."""
    shared = 0
    while start + shared < min(len(keys), len(leader)) and keys[start + shared] == leader[start + shared]:
        shared += 1
    saved = shared * BLOCK
    return saved >= WAIT_TOKENS or saved >= WAIT_SHARE * (prompt - 1 - start * BLOCK)


def prefix_cache_bytes(setting: int | str, device: torch.device) -> int:
    """The prefix cache's budget in bytes: ``setting``, or for ``"auto"`` :data:`AUTO_SHARE` of the device's free
    memory now (the models are loaded; on the CPU what the system could give, :func:`available_bytes`), at most
    :data:`AUTO_MAX`."""
    if setting != AUTO:
        return int(setting)
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else available_bytes()
    return min(AUTO_MAX, int(free * AUTO_SHARE))


def block_keys(namespace: str, tokens: list[int] | tuple[int, ...]) -> list[int]:
    """The key of every whole block of ``tokens`` (see the module's terms).

    Example: 40 tokens, ``BLOCK = 16`` → two keys (tokens 0-15, then 0-31); the last 8 tokens are no block.
    """
    keys, key = [], hash(("batchspec-prefix", namespace))
    for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
        key = hash((key, tuple(tokens[start : start + BLOCK])))
        keys.append(key)
    return keys


def _copy_columns(cache: BatchKVCache, row: int, start: int, columns: int) -> BatchKVCache:
    """A one-row cache holding a copy of ``columns`` columns of ``cache``'s row ``row`` from column ``start``."""
    storage = cache.storage[:, :, row : row + 1, :, start : start + columns].clone()  # [N, 2, 1, H, columns, D]
    return BatchKVCache(len(cache.layers), storage, columns)
